"""Residency plans: which ops a stage's device holds at each step, fetched and evicted from a known future.

A stage's future is known: the sampler's lookahead and the plans made ahead say which ops it runs
at each coming step (``uses[t]``: the op ids step ``t`` needs, all of them resident while it runs).
Every op has a home in host memory; the device holds a bounded working set (``budget`` bytes of
op state; the runtime reserves activations and grads outside it). :func:`plan_residency` turns the
future into a :class:`ResidencyPlan` — data, step by step: what is fetched (on demand at the start
of the step, or ahead, during it), what is evicted (and written back when dirty), hits, misses and
the peak resident bytes — which the runtime executes and :mod:`pipeline.plan.simulate` times.

Policies (``policy=``) are the objects of :mod:`pipeline.plan.policy`, the same ones the
runtime store asks, so the plan and the run evict alike: ``belady`` (furthest next use; with
unit sizes and no prefetch Belady's MIN, optimal; with mixed sizes the usual heuristic, as
optimal caching with sizes is NP-hard), ``lru`` and ``on_demand`` (no prefetch). The ops of the
next ``prefetch_depth`` steps are fetched ahead, in order of use, while the policy finds a
victim (never one the current step needs), at most ``max_copies`` fetches ahead per step.

Per step the plan reports, for every op the step needs, whether it was a *hit* (resident from an
earlier use or left there), *prefetched* (fetched ahead for this use) or a *miss* (fetched on
demand, the compute waits for it). ``reuse=False`` models an op whose device copy is stale after
each use (the optimizer runs on the host): it is dropped when its step ends, so every use fetches.
:func:`next_use` answers the runtime's online question: when is this op needed next.
"""
from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .policy import NEVER, POLICIES, Candidate, policy_named

__all__ = ["NEVER", "ResidencyError", "StepResidency", "ResidencyPlan", "NextUse", "next_use", "plan_residency"]

_MIB = float(2**20)


class ResidencyError(ValueError):
    """A residency problem is malformed or its budget cannot hold one step's ops."""

    def __init__(self, message: str, short_by: int | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.short_by = short_by  # bytes missing on the tightest step
        self.step = step


@dataclass(frozen=True)
class StepResidency:
    """What happens on the device around step ``step``.

    ``demand`` ops are fetched at the step's start (the step waits for them); ``prefetch`` ops
    are fetched during the step for later steps. ``evict`` lists every op dropped during the
    step, in order (``demand_evict`` those dropped to make room for the demand fetches, before
    the step; ``writeback``: the evicted ops whose state changed since they were fetched, copied
    back to the host first). ``dropped``: with ``reuse=False``, the ops invalidated when the step
    ends. ``peak_bytes``: the most resident bytes at any point of the step.
    """

    step: int
    hits: tuple[str, ...]
    prefetched: tuple[str, ...]
    misses: tuple[str, ...]
    demand_evict: tuple[str, ...]
    prefetch: tuple[str, ...]
    evict: tuple[str, ...]
    writeback: tuple[str, ...]
    dropped: tuple[str, ...]
    peak_bytes: int
    resident_bytes: int  # at the end of the step (after prefetching)
    evicted_for: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (fetched op, the ops evicted to make its room)

    @property
    def fetches(self) -> tuple[str, ...]:
        """Every op copied host -> device during this step, demand fetches first."""
        return self.misses + self.prefetch


@dataclass(frozen=True)
class ResidencyPlan:
    """A policy's plan over a whole trace, with its totals."""

    policy: str
    budget: int
    steps: tuple[StepResidency, ...]
    uses: int
    hits: int
    prefetched: int
    misses: int
    fetched_bytes: int
    writeback_bytes: int
    peak_bytes: int

    @property
    def hit_rate(self) -> float:
        """Uses served by a copy already on the device from before (no transfer for this use)."""
        return self.hits / self.uses if self.uses else 1.0

    @property
    def fetches(self) -> int:
        return self.prefetched + self.misses


@dataclass(frozen=True)
class NextUse:
    """Per op, the sorted steps that use it; :meth:`after` is the next use at or after a step."""

    steps_of: Mapping[str, tuple[int, ...]]

    def after(self, op_id: str, step: int) -> float:
        """The first step ``>= step`` that uses ``op_id`` (``inf`` when none does)."""
        steps = self.steps_of.get(op_id, ())
        k = bisect.bisect_left(steps, step)
        return steps[k] if k < len(steps) else NEVER


def next_use(uses: Sequence[Iterable[str]]) -> NextUse:
    """The next-use index of a trace: ``next_use(uses).after(op, t)``."""
    steps_of: dict[str, list[int]] = {}
    for t, ops in enumerate(uses):
        for op in dict.fromkeys(ops):
            steps_of.setdefault(op, []).append(t)
    return NextUse({op: tuple(s) for op, s in steps_of.items()})


def _check(uses: Sequence[Iterable[str]], sizes: Mapping[str, int], budget: int, policy: str,
           prefetch_depth: int, max_copies: int | None, host_sizes: Mapping[str, int],
           on_host: Sequence[Collection[str]] | None) -> list[tuple[str, ...]]:
    if policy not in POLICIES:
        raise ResidencyError(f"policy: expected one of {list(POLICIES)}, found {policy!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ResidencyError(f"budget: expected a non-negative int (bytes), found {budget!r}")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ResidencyError(f"prefetch_depth: expected a non-negative int (steps), found {prefetch_depth!r}")
    if max_copies is not None and (isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1):
        raise ResidencyError(f"max_copies: expected a positive int or None, found {max_copies!r}")
    trace = [tuple(dict.fromkeys(ops)) for ops in uses]
    if on_host is not None and len(on_host) != len(trace):
        raise ResidencyError(f"on_host: expected one op set per step ({len(trace)}), found {len(on_host)}")
    for name, table in (("sizes", sizes), ("host_sizes", host_sizes)):
        for t, ops in enumerate(trace):
            for op in ops:
                if name == "host_sizes" and (on_host is None or op not in on_host[t]):
                    continue
                size = table.get(op)
                if size is None:
                    raise ResidencyError(f"uses[{t}]: op {op!r} has no entry in {name}; expected every used op sized")
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise ResidencyError(f"{name}[{op!r}]: expected a non-negative int (bytes), found {size!r}")
    need = [sum(host_sizes[op] if on_host is not None and op in on_host[t] else sizes[op] for op in ops)
            for t, ops in enumerate(trace)]
    if need and max(need) > budget:
        t = max(range(len(need)), key=need.__getitem__)
        short = need[t] - budget
        raise ResidencyError(
            f"budget: step {t} needs {len(trace[t])} ops resident at once, {need[t]} bytes "
            f"({need[t] / _MIB:.2f} MiB), against a budget of {budget} bytes ({budget / _MIB:.2f} MiB): "
            f"short by {short} bytes ({short / _MIB:.2f} MiB). Hint: raise the budget to at least {need[t]} bytes "
            "(in a run: memory.device_budget_bytes), use more stages (fewer ops per stage), or move the optimizer "
            "state to the host (memory.optimizer=host)", short_by=short, step=t)
    return trace


def plan_residency(
    uses: Sequence[Iterable[str]],
    sizes: Mapping[str, int],
    budget: int,
    policy: str = "belady",
    prefetch_depth: int = 1,
    max_copies: int | None = None,
    reuse: bool = True,
    dirty_on_use: bool = True,
    resident: Iterable[str] = (),
    on_host: Sequence[Collection[str]] | None = None,
    host_sizes: Mapping[str, int] | None = None,
) -> ResidencyPlan:
    """Plan one stage's residency over the trace ``uses`` (per step, the op ids it needs).

    ``sizes``: bytes each op occupies on the device; ``budget``: bytes of op state the device may
    hold (a step's ops must fit: else :class:`ResidencyError` with ``short_by``). ``prefetch_depth``:
    how many steps ahead to fetch (``on_demand`` ignores it); ``max_copies``: most fetches ahead per
    step (None: as many as fit). ``dirty_on_use``: a used op's state changed (updated on the device),
    so evicting it writes it back; ``reuse=False``: a used op's device copy is stale when its step
    ends (the update ran on the host) and is dropped then. ``resident``: ops already on the device
    at the start (clean; they must fit in the budget).

    ``on_host`` (per step, the ops whose update that step runs on the host: the hybrid placement
    of :mod:`pipeline.plan.hybrid`) with ``host_sizes`` (their bytes on the device then, weights
    only): such a use fetches ``host_sizes[op]`` and drops the copy when the step ends, as with
    ``reuse=False``; every other use is updated on the device. An op still resident from a
    device-updated use is a hit whatever ``on_host`` says: it is updated on the device again.
    """
    if not reuse:  # every use updated on the host
        on_host, host_sizes = [tuple(ops) for ops in uses], sizes
    host_sizes = host_sizes if host_sizes is not None else {}
    trace = _check(uses, sizes, budget, policy, prefetch_depth, max_copies, host_sizes, on_host)
    rule = policy_named(policy)
    future = next_use(trace)
    depth = prefetch_depth if rule.prefetches else 0
    res: dict[str, int] = {}           # resident ops -> their bytes, least recently used first (dict keeps order)
    stale: set[str] = set()            # resident for a use updated on the host: dropped when that step ends
    dirty: set[str] = set()
    ahead: set[str] = set()            # prefetched and not used yet
    used_bytes = 0
    for op in dict.fromkeys(resident):
        if op not in sizes:
            raise ResidencyError(f"resident: op {op!r} has no entry in sizes")
        res[op] = sizes[op]
        used_bytes += sizes[op]
    if used_bytes > budget:
        raise ResidencyError(f"resident: the ops given as resident take {used_bytes} bytes, over the budget "
                             f"of {budget} bytes by {used_bytes - budget}", short_by=used_bytes - budget)
    if not reuse:
        stale.update(res)

    def size_for(u: int, op: str) -> int:
        """The bytes a fetch of ``op`` for its use at step ``u`` brings (it is not resident)."""
        return host_sizes[op] if on_host is not None and op in on_host[u] else sizes[op]

    def victim(t: int, pinned: set[str], fetch_use: float | None) -> str | None:
        """The op to evict for a fetch needed at ``fetch_use`` (None: on demand) during step ``t``."""
        v = rule.victim((Candidate(op, future.after(op, t), op in ahead) for op in res if op not in pinned), fetch_use)
        return None if v is None else v.op_id

    def place(op: str, u: int) -> int:
        nonlocal used_bytes
        n = res[op] = size_for(u, op)
        if on_host is not None and op in on_host[u]:
            stale.add(op)
        used_bytes += n
        totals["fetched"] += n
        return n

    steps: list[StepResidency] = []
    totals = dict(hits=0, prefetched=0, misses=0, fetched=0, written=0, peak=used_bytes)
    for t, need in enumerate(trace):
        pinned = set(need)
        hits = tuple(op for op in need if op in res and op not in ahead)
        pre = tuple(op for op in need if op in ahead)
        miss = tuple(op for op in need if op not in res)
        evict: list[str] = []
        writeback: list[str] = []

        def drop(op: str) -> None:
            nonlocal used_bytes
            used_bytes -= res.pop(op)
            ahead.discard(op)
            stale.discard(op)
            evict.append(op)
            if op in dirty:
                dirty.discard(op)
                writeback.append(op)
                totals["written"] += sizes[op]

        # demand fetches: the step waits for them; any unpinned op may go (the step cannot run otherwise)
        evicted_for: list[tuple[str, tuple[str, ...]]] = []
        for op in miss:
            made: list[str] = []
            while used_bytes + size_for(t, op) > budget:
                v = victim(t, pinned, None)
                if v is None:  # unreachable: _check proved the step's ops fit
                    raise ResidencyError(f"step {t}: no op to evict for {op!r}")
                drop(v)
                made.append(v)
            if made:
                evicted_for.append((op, tuple(made)))
            place(op, t)
        demand_evict = tuple(evict)
        for op in need:  # used now: most recently used, and dirty once updated on the device
            res[op] = res.pop(op)
            ahead.discard(op)
            if dirty_on_use and op not in stale:
                dirty.add(op)
        peak = used_bytes

        # prefetch for the next steps, in order of use, while a victim used later than the op exists
        prefetch: list[str] = []
        room = True
        for u in range(t + 1, min(t + 1 + depth, len(trace))):
            for op in trace[u]:
                if op in res or (max_copies is not None and len(prefetch) >= max_copies):
                    continue
                keep = pinned | set(prefetch) | {op}
                if rule.spares_fetched_step:
                    keep |= set(trace[u])
                n = size_for(u, op)
                victims, free = [], budget - used_bytes
                while free < n:  # choose every victim first: evict only if the fetch fits
                    v = victim(t, keep | set(victims), float(u))
                    if v is None:
                        break
                    victims.append(v)
                    free += res[v]
                # Stop looking ahead when there is no room without evicting something needed
                # sooner, or when the policy would rather wait for this step's ops to become
                # candidates (they do once it ends).
                room = free >= n and rule.fetch_ahead_pays(
                    u - t, (future.after(v, t + 1) for v in victims), (future.after(p, t + 1) for p in need))
                if not room:
                    break
                for v in victims:
                    drop(v)
                if victims:
                    evicted_for.append((op, tuple(victims)))
                place(op, u)
                ahead.add(op)
                prefetch.append(op)
                peak = max(peak, used_bytes)
            if not room:
                break
        # the host updates these after the step: their device copies are stale
        dropped = tuple(op for op in need if op in stale)
        for op in dropped:
            used_bytes -= res.pop(op)
            stale.discard(op)
        totals["hits"] += len(hits)
        totals["prefetched"] += len(pre)
        totals["misses"] += len(miss)
        totals["peak"] = max(totals["peak"], peak)
        steps.append(StepResidency(t, hits, pre, miss, demand_evict, tuple(prefetch), tuple(evict),
                                   tuple(writeback), dropped, peak, used_bytes, tuple(evicted_for)))
    return ResidencyPlan(policy, budget, tuple(steps), sum(len(n) for n in trace), totals["hits"],
                         totals["prefetched"], totals["misses"], totals["fetched"], totals["written"],
                         totals["peak"])
