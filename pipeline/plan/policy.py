"""Eviction policies: which resident op makes room, and what is fetched ahead (pure).

One object per policy answers for both callers, so the plan and the run cannot disagree: the
offline residency planner (:func:`pipeline.plan.residency.plan_residency`, which ``bench/vtm.py``
replays) and the runtime store (:class:`pipeline.memory.virtual.VirtualStore`). Each hands the
policy its eviction candidates as :class:`Candidate` values, least recently used first, with
each one's next use in the known future; a fetch is either on *demand* (``fetch_use=None``: the
step cannot run without it, so any candidate may go) or *ahead*, for a use at ``fetch_use``.

* :data:`BELADY`: evict the op whose next use is furthest away, least recently used among
  equals; a fetch ahead never evicts an op needed no later than the op being fetched. With unit
  sizes and no prefetch this is Belady's MIN, optimal (tests check it against exhaustive search).
* :data:`LRU`: prefetch from the lookahead as Belady does, evict the least recently used op that
  was not fetched ahead (a demand fetch may take an op fetched ahead too); a fetch ahead for a
  step never evicts another op of that step (the only use LRU makes of the future).
* :data:`ON_DEMAND`: LRU eviction, no prefetch: a step's missing ops are fetched when it starts.

Adding a policy is one subclass of :class:`EvictionPolicy` and one entry in :data:`BY_NAME`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["NEVER", "Candidate", "EvictionPolicy", "Belady", "Lru", "BELADY", "LRU", "ON_DEMAND", "BY_NAME",
           "POLICIES", "policy_named"]

NEVER = float("inf")  # the next use of an op the known future does not use again


class Candidate(NamedTuple):
    """A resident op that may be evicted: ``next_use`` is the step (or future index) it is needed
    next (:data:`NEVER`: not in the known future); ``ahead``: it was fetched ahead and not used yet."""

    op_id: str
    next_use: float
    ahead: bool = False


class EvictionPolicy:
    """The interface: ``victim`` (the one rule), ``alike`` (its ties), and how it prefetches."""

    name: str = ""
    prefetches: bool = True  # fetches ops of coming steps ahead of their use
    spares_fetched_step: bool = False  # a fetch ahead for step u never evicts another op of step u

    def victim(self, candidates: Iterable[Candidate], fetch_use: float | None) -> Candidate | None:
        """The op to evict for a fetch needed at ``fetch_use`` (``None``: on demand), from
        ``candidates`` least recently used first; ``None`` when the policy evicts none of them."""
        raise NotImplementedError

    def alike(self, candidates: Sequence[Candidate], fetch_use: float | None) -> list[Candidate]:
        """The candidates the rule ranks first together (any of them is as good an eviction),
        least recently used first: a store with a fragmented arena takes the one whose region
        opens a large enough hole. Empty where the rule admits no ties."""
        return []

    def fetch_ahead_pays(self, steps_ahead: int, victims_next: Iterable[float], step_next: Iterable[float]) -> bool:
        """Whether a fetch ``steps_ahead`` steps before its use, evicting ops used next at
        ``victims_next``, is worth making now rather than when the current step's ops (next used
        at ``step_next``) become candidates too, as they do once the step ends (the offline
        planner asks; the runtime prefetches between steps, when they are candidates already)."""
        return True

    def __repr__(self) -> str:
        return f"<eviction policy {self.name}>"


class Belady(EvictionPolicy):
    """Furthest next use first (see the module docstring)."""

    name = "belady"

    def victim(self, candidates: Iterable[Candidate], fetch_use: float | None) -> Candidate | None:
        best, best_use = None, -NEVER if fetch_use is None else fetch_use
        for c in candidates:  # strictly later: ties go to the least recently used
            if c.next_use > best_use:
                best, best_use = c, c.next_use
        return best

    def alike(self, candidates: Sequence[Candidate], fetch_use: float | None) -> list[Candidate]:
        if not candidates:
            return []
        far = max(c.next_use for c in candidates)
        if fetch_use is not None and not far > fetch_use:
            return []
        return [c for c in candidates if c.next_use == far]

    def fetch_ahead_pays(self, steps_ahead: int, victims_next: Iterable[float], step_next: Iterable[float]) -> bool:
        # Beyond the next step, a victim used sooner than one of the current step's ops would be
        # a fetch more than waiting for that op to become the victim.
        return steps_ahead <= 1 or not min(victims_next, default=NEVER) < max(step_next, default=-NEVER)


class Lru(EvictionPolicy):
    """Least recently used first, sparing ops fetched ahead (see the module docstring)."""

    name = "lru"
    spares_fetched_step = True

    def __init__(self, name: str = "lru", prefetches: bool = True) -> None:
        self.name, self.prefetches = name, prefetches

    def victim(self, candidates: Iterable[Candidate], fetch_use: float | None) -> Candidate | None:
        first = None
        for c in candidates:
            if not c.ahead:
                return c
            if first is None:
                first = c
        return first if fetch_use is None else None  # a demand fetch may take an op fetched ahead


BELADY = Belady()
LRU = Lru()
ON_DEMAND = Lru("on_demand", prefetches=False)
BY_NAME: dict[str, EvictionPolicy] = {p.name: p for p in (BELADY, LRU, ON_DEMAND)}
POLICIES = tuple(BY_NAME)


def policy_named(name: str) -> EvictionPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"policy: expected one of {list(POLICIES)}, found {name!r}") from None
