"""Hybrid optimizer placement: per op and step, whether the update runs on the device or the host (pure).

An op of ``w`` bytes of weights (and as many of gradients) and ``s`` bytes of optimizer state can
be served, at each use, two ways (the physics of :mod:`pipeline.plan.simulate`):

* in a **device run**: the op is fetched with its state before the run's first use (``w + s``
  up), stays resident through its last use, and is written back after it (``w + s`` down); every
  use of the run is updated on the device and moves nothing. Holding it costs ``hold`` per byte
  per step of the run's span (the price of the device memory it keeps from other ops; 0: free);
  a run may not span a gap between uses longer than ``max_gap`` steps (the lookahead it is
  planned from: what the next subnets reuse);
* as a **host use**: its weights go up (``w``), its gradients come down (``w``) and the host
  updates it (``host_cost``, in the same units): the state stays in the op's host home.

:func:`plan_hybrid` chooses, for every op, the runs and host uses of least total cost: a dynamic
program over the op's uses (ops are independent under this model; the device budget is then kept
by the residency plan, :func:`pipeline.plan.residency.plan_residency` with ``on_host``, which
evicts a run's op early when room is short). Tests check it against exhaustive search.

The rule the issue asks for is one setting of it: with ``hold = 0`` and ``host_cost = s`` a use
that the op's next use follows within ``max_gap`` steps keeps its state on the device (a run of
two uses costs ``2(w + s)`` against ``2(2w + s)`` as two host uses), and a use with no reuse that
close goes home (``2w + s`` against ``2(w + s)``). :func:`reuse_rule` gives that rule's costs;
the runtime store asks it over the future the engine announces.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HybridCosts", "HybridPlan", "REUSE_NEXT", "reuse_rule", "plan_hybrid", "op_runs", "limit_host",
           "shed_to_fit"]


@dataclass(frozen=True)
class HybridCosts:
    """The prices :func:`plan_hybrid` weighs (see the module docstring); ``max_gap`` in steps
    (``None``: no limit)."""

    hold: float = 0.0
    host_cost: float | Mapping[str, float] | None = None  # None: each op's state bytes
    max_gap: int | None = None

    def __post_init__(self) -> None:
        if not self.hold >= 0:
            raise ValueError(f"HybridCosts.hold: expected a non-negative price per byte-step, found {self.hold!r}")
        if self.max_gap is not None and (isinstance(self.max_gap, bool) or not isinstance(self.max_gap, int)
                                         or self.max_gap < 1):
            raise ValueError(f"HybridCosts.max_gap: expected a positive int (steps) or None, found {self.max_gap!r}")

    def host(self, op: str, state_bytes: int) -> float:
        if self.host_cost is None:
            return float(state_bytes)
        if isinstance(self.host_cost, Mapping):
            return float(self.host_cost[op])
        return float(self.host_cost)


def reuse_rule(max_gap: int | None) -> HybridCosts:
    """Keep the state on the device while the op's next use is at most ``max_gap`` steps away,
    send it home otherwise (``hold = 0``, ``host_cost`` = the state's bytes)."""
    return HybridCosts(0.0, None, max_gap)


REUSE_NEXT = reuse_rule(1)  # the runtime's rule: the state stays while the next subnet reuses the op


@dataclass(frozen=True)
class HybridPlan:
    """Per step, the ops updated on the host (``on_host[t]``) and on the device; ``cost``: the
    model's total (bytes moved, host work and holding, in bytes)."""

    on_host: tuple[frozenset[str], ...]
    on_device: tuple[frozenset[str], ...]
    cost: float

    @property
    def host_share(self) -> float:
        """Share of the uses updated on the host."""
        h = sum(len(s) for s in self.on_host)
        n = h + sum(len(s) for s in self.on_device)
        return h / n if n else 0.0


def op_runs(steps: Sequence[int], w: int, s: int, host: float, costs: HybridCosts) -> tuple[float, tuple[bool, ...]]:
    """One op's least cost over its sorted use ``steps``, and per use whether it is in a device run."""
    k = len(steps)
    best = [0.0] * (k + 1)  # best[j]: least cost of the first j uses
    choice: list[tuple[str, int]] = [("none", 0)] * (k + 1)
    for j in range(1, k + 1):
        best[j], choice[j] = best[j - 1] + 2 * w + host, ("host", j - 1)
        for i in range(j, 0, -1):  # a run over uses i-1 .. j-1
            if i < j and costs.max_gap is not None and steps[i] - steps[i - 1] > costs.max_gap:
                break
            c = best[i - 1] + 2 * (w + s) + costs.hold * (w + s) * (steps[j - 1] - steps[i - 1])
            if c < best[j]:  # ties stay on the host: memory kept free
                best[j], choice[j] = c, ("run", i - 1)
    on_device = [False] * k
    j = k
    while j > 0:
        kind, i = choice[j]
        if kind == "run":
            for u in range(i, j):
                on_device[u] = True
        j = i
    return best[k], tuple(on_device)


def plan_hybrid(uses: Sequence[Iterable[str]], weight_bytes: Mapping[str, int], state_bytes: Mapping[str, int],
                costs: HybridCosts = HybridCosts()) -> HybridPlan:
    """Per op, the device runs and host uses of least cost over the trace ``uses`` (per step,
    the op ids it needs); ``weight_bytes`` and ``state_bytes`` per op."""
    trace = [tuple(dict.fromkeys(ops)) for ops in uses]
    steps_of: dict[str, list[int]] = {}
    for t, ops in enumerate(trace):
        for op in ops:
            steps_of.setdefault(op, []).append(t)
    on_host: list[set[str]] = [set() for _ in trace]
    on_device: list[set[str]] = [set() for _ in trace]
    total = 0.0
    for op, steps in steps_of.items():
        try:
            w, s = int(weight_bytes[op]), int(state_bytes[op])
        except KeyError:
            raise ValueError(f"plan_hybrid: op {op!r} has no entry in weight_bytes or state_bytes") from None
        cost, dev = op_runs(steps, w, s, costs.host(op, s), costs)
        total += cost
        for t, d in zip(steps, dev):
            (on_device if d else on_host)[t].add(op)
    return HybridPlan(tuple(frozenset(x) for x in on_host), tuple(frozenset(x) for x in on_device), total)


def _move_until(source: set[str], target: set[str], order: Iterable[str], load: float, capacity: float,
                bytes_of: Mapping[str, int]) -> None:
    """Move ops from ``source`` to ``target`` in ``order`` while ``load`` is over ``capacity``;
    each move takes ``bytes_of[op]`` off it."""
    for op in order:
        if load <= capacity:
            return
        source.discard(op)
        target.add(op)
        load -= bytes_of[op]


def limit_host(plan: HybridPlan, uses: Sequence[Iterable[str]], weight_bytes: Mapping[str, int],
               capacity: Sequence[float]) -> HybridPlan:
    """The plan with at most ``capacity[t]`` bytes of weights updated on the host at step ``t``
    (what the host can update while a step runs): over it, the host uses whose op is needed
    again soonest move to the device (a device run of one use), where waiting for the host would
    cost the most. ``cost`` is not recomputed."""
    trace = [tuple(dict.fromkeys(ops)) for ops in uses]
    if len(capacity) != len(trace):
        raise ValueError(f"limit_host: expected one capacity per step ({len(trace)}), found {len(capacity)}")
    later: dict[str, list[int]] = {}
    for t in range(len(trace) - 1, -1, -1):
        for op in trace[t]:
            later.setdefault(op, []).append(t)  # descending: the last entry is the next use
    on_host = list(plan.on_host)
    on_device = list(plan.on_device)
    never = len(trace)
    for t, ops in enumerate(trace):
        for op in ops:
            later[op].pop()  # this use
        load = sum(weight_bytes[o] for o in on_host[t])
        if load <= capacity[t]:
            continue
        host, dev = set(on_host[t]), set(on_device[t])
        _move_until(host, dev, sorted(host, key=lambda o: (later[o][-1] if later[o] else never, o)), load,
                    capacity[t], weight_bytes)
        on_host[t], on_device[t] = frozenset(host), frozenset(dev)
    return HybridPlan(tuple(on_host), tuple(on_device), plan.cost)


def shed_to_fit(plan: HybridPlan, uses: Sequence[Iterable[str]], weight_bytes: Mapping[str, int],
                state_bytes: Mapping[str, int], capacity: float) -> HybridPlan:
    """The plan with every step's ops fitting ``capacity`` device bytes together: where a step's
    weights and device-kept state are over, its device uses become host uses in op-id order
    until they fit (what the runtime store does when the ops a step needs do not fit with the
    state some of them keep, ``VirtualStore._shed_state``). A step still over with every use on
    the host is left (the residency plan reports it). ``cost`` is not recomputed."""
    trace = [tuple(dict.fromkeys(ops)) for ops in uses]
    if len(plan.on_host) != len(trace):
        raise ValueError(f"shed_to_fit: expected a plan of {len(trace)} steps, found {len(plan.on_host)}")
    on_host, on_device = list(plan.on_host), list(plan.on_device)
    for t, ops in enumerate(trace):
        total = sum(weight_bytes[o] + (0 if o in on_host[t] else state_bytes[o]) for o in ops)
        if total <= capacity:
            continue
        host, dev = set(on_host[t]), set(on_device[t])
        _move_until(dev, host, sorted(dev), total, capacity, state_bytes)
        on_host[t], on_device[t] = frozenset(host), frozenset(dev)
    return HybridPlan(tuple(on_host), tuple(on_device), plan.cost)
