"""Admission: the cross-subnet schedule every rank builds alike, from the lookahead and the costs.

Several subnets are in flight at once, and the result is still the sequential one: an op is
updated in subnet order and each forward reads the version :class:`~pipeline.plan.schedule.WaitRule`
names (exact: after the previous user's update; ``delayed`` shared ops: ``delay`` updates late;
``frozen``: never updated). A subnet enters a stage as soon as the updates it reads there are
done, so later subnets whose ops do not conflict overtake blocked ones; at most ``window``
subnets are unfinished at once (``window = 1`` is the flushed step of today, 1F1B inside each
subnet).

The builder is a list scheduler over estimated times: each stage, when free, runs the ready
action of highest priority (an update, then a backward, then a forward; older subnets and
micro-batches first), and a stage holds at most ``cap[s]`` micro-batches between forward and
backward (``P - s`` by default: 1F1B's bound, now across subnet boundaries). The estimates
only choose the order: the order is then a fixed schedule that the executor runs with real
waits, so a wrong estimate costs bubble, never correctness. Pure: values in, values out; every
rank computes the same schedule from the same inputs without a message.

    P=2, M=2, two subnets that share no op, window 2 (``a@t``: subnet ``t``)::

        stage 0 |  0F0  0F1  0B0  0F0@1  0B1  0U  0F1@1  0B0@1  0B1@1  0U@1
        stage 1 |  1F0  1B0  1F1  1B1  1U  1F0@1  1B0@1  1F1@1  1B1@1  1U@1
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .schedule import Action, Schedule, ScheduleError, Wait, WaitRule

__all__ = ["SubnetWork", "cross_subnet", "flushed", "in_flight_bound"]

_PRIORITY = {"U": 0, "B": 1, "F": 2}


@dataclass(frozen=True)
class SubnetWork:
    """One subnet of the sequence: per stage, the ops with state it runs there (``uses``) and
    the seconds of one micro-batch's forward and backward (``fwd``, ``bwd``); per cut, the
    seconds its activation or gradient takes on the link (``send``); per stage, the update's
    seconds (``update``, default 0)."""

    uses: tuple[frozenset[str], ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    send: tuple[float, ...] = ()
    update: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        P = len(self.uses)
        object.__setattr__(self, "uses", tuple(frozenset(u) for u in self.uses))
        for name, n in (("fwd", P), ("bwd", P), ("send", P - 1), ("update", P)):
            v = tuple(float(x) for x in getattr(self, name)) or ((0.0,) * n if name in ("send", "update") else ())
            if len(v) != n or not all(math.isfinite(x) and x >= 0 for x in v):
                raise ScheduleError(f"SubnetWork.{name}: expected {n} finite non-negative seconds, found {v!r}")
            object.__setattr__(self, name, v)


def cross_subnet(work: Sequence[SubnetWork], num_microbatches: int, window: int, *,
                 frozen: frozenset[str] = frozenset(), delayed: frozenset[str] = frozenset(), delay: int = 0,
                 origin: Mapping[str, int] | None = None, state_time: Mapping[str, float] | None = None,
                 cap: Sequence[int] | None = None, name: str = "cross") -> Schedule:
    """The schedule of ``work`` (subnets in training order) with at most ``window`` unfinished.

    ``state_time[op]``: seconds an op's move takes (default 0); ``origin``: each op's stage
    before the first action. Raises :class:`ScheduleError` for inputs of the wrong shape.
    """
    if not work:
        raise ScheduleError("cross_subnet: expected at least one subnet, found none")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ScheduleError(f"pipeline.window: expected an int >= 1, found {window!r}")
    T, P, M = len(work), len(work[0].uses), num_microbatches
    if any(len(w.uses) != P for w in work):
        raise ScheduleError(f"cross_subnet: every subnet needs {P} stages, found {[len(w.uses) for w in work]}")
    cap = tuple(cap) if cap is not None else tuple(P - s for s in range(P))
    if len(cap) != P or any(c < 1 for c in cap):
        raise ScheduleError(f"cross_subnet: cap expected {P} values >= 1, found {cap!r}")
    uses = tuple(w.uses for w in work)
    rule = WaitRule(P, M, T, uses, frozenset(frozen), frozenset(delayed), delay,
                    dict(origin) if origin is not None else None, updates=True)
    moving = state_time or {}
    end: dict[Action, float] = {}
    rows: list[list[Action]] = [[] for _ in range(P)]
    free = [0.0] * P
    nf = [[0] * T for _ in range(P)]  # the next forward's micro-batch, per stage and subnet
    nb = [[0] * T for _ in range(P)]
    updated = [[False] * T for _ in range(P)]
    live = [0] * P  # micro-batches between forward and backward
    done_stages = [0] * T
    lo = 0  # the oldest unfinished subnet

    def arrival(w: Wait, a: Action) -> float | None:
        if w.action is None:
            return moving.get(w.op, 0.0)
        e = end.get(w.action)
        if e is None or w.message in (None, "losses"):
            return e
        if w.message == "state":
            return e + moving.get(w.op, 0.0)
        cut = min(w.action.stage, a.stage)
        return e + work[a.subnet].send[cut]

    settled: dict[Action, float] = {}  # ready times whose waits have all been placed (final)

    def ready(a: Action) -> float | None:
        got = settled.get(a)
        if got is not None:
            return got
        t = 0.0
        for w in rule.waits(a):
            r = arrival(w, a)
            if r is None:
                return None
            t = max(t, r)
        settled[a] = t
        return t

    F = [[[Action(s, "F", m, t) for m in range(M)] for t in range(T)] for s in range(P)]  # made once
    B = [[[Action(s, "B", m, t) for m in range(M)] for t in range(T)] for s in range(P)]
    U = [[Action(s, "U", 0, t) for t in range(T)] for s in range(P)]

    def candidates(s: int):
        for t in range(lo, min(T, lo + window)):
            if nf[s][t] < M and live[s] < cap[s]:
                yield F[s][t][nf[s][t]]
            if nb[s][t] < nf[s][t]:
                yield B[s][t][nb[s][t]]
            if nb[s][t] == M and not updated[s][t]:
                yield U[s][t]

    def propose(s: int) -> tuple[float, int, Action] | None:
        """Stage ``s``'s next action: when it can start, and which (the highest priority ready then)."""
        cands = [(a, r) for a in candidates(s) if (r := ready(a)) is not None]
        if not cands:
            return None
        start = max(free[s], min(r for _, r in cands))
        a = min((a for a, r in cands if r <= start), key=lambda a: (_PRIORITY[a.kind], a.subnet, a.microbatch))
        return start, s, a

    # a stage's proposal changes only when it runs something, when a message for it is sent,
    # or when the window moves: recomputed then, not at every placement
    proposals: list[tuple[float, int, Action] | None] = [propose(s) for s in range(P)]
    remaining = T * P * (2 * M + 1)
    while remaining:
        best = min((p for p in proposals if p is not None), default=None)
        if best is None:  # the rule's waits all point at earlier subnets: cannot happen
            raise ScheduleError(f"cross_subnet: no stage can progress with {remaining} actions left (window {window})")
        start, s, a = best
        w = work[a.subnet]
        end[a] = free[s] = start + {"F": w.fwd, "B": w.bwd, "U": w.update}[a.kind][s]
        rows[s].append(a)
        remaining -= 1
        stale = {s} | {dst for dst, _ in rule.sends(a)}
        if a.kind == "F":
            nf[s][a.subnet] += 1
            live[s] += 1
        elif a.kind == "B":
            nb[s][a.subnet] += 1
            live[s] -= 1
        else:
            updated[s][a.subnet] = True
            done_stages[a.subnet] += 1
            if lo < T and done_stages[lo] == P:
                while lo < T and done_stages[lo] == P:
                    lo += 1
                stale = set(range(P))
        for k in stale:
            proposals[k] = propose(k)
    return Schedule(name, P, M, tuple(tuple(r) for r in rows), num_subnets=T, uses=uses,
                    frozen=frozenset(frozen), delayed=frozenset(delayed), delay=delay,
                    origin=tuple(sorted(origin.items())) if origin is not None else None)


def in_flight_bound(num_stages: int, num_microbatches: int, window: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations a cross-subnet schedule holds: the
    builder's cap ``P - s``, and no more than ``window`` subnets' ``M`` each (what the
    partitioner's and the activation plan's memory model count)."""
    return tuple(min(num_stages - s, window * num_microbatches) for s in range(num_stages))


def flushed(work: Sequence[SubnetWork], num_microbatches: int, **kw) -> Schedule:
    """Today's step as a cross-subnet schedule: one subnet at a time, drained before the next."""
    return cross_subnet(work, num_microbatches, 1, **kw)
