"""Admission: the cross-subnet schedule every rank builds alike, from the lookahead and the costs.

Several subnets are in flight at once, and the result is still the sequential one: an op is
updated in subnet order and each forward reads the version :class:`~pipeline.plan.schedule.WaitRule`
names (exact: after the previous user's update; ``delayed`` shared ops: ``delay`` updates late;
``frozen``: never updated). A subnet enters a stage as soon as the updates it reads there are
done, so later subnets whose ops do not conflict overtake blocked ones; at most ``window``
subnets are unfinished at once: between the oldest unfinished subnet and the newest admitted
one, so on each stage's list at most ``window`` subnets lie between their first action there
and their update there, whatever the real times. ``window = 1`` is the flushed step of today:
with equal stage costs exactly 1F1B inside each subnet; with unequal ones a stage may run a
backward that is ready before a forward that 1F1B would wait for (never more in flight).

The builder is a list scheduler over estimated times, taken from the simulator's clock
(:class:`~pipeline.plan.clock.Clock`, so the estimates are exactly what
:func:`~pipeline.plan.simulate.simulate` replays of the result): each stage, when free, runs the
ready action of highest priority (an update, then a backward, then a forward; older subnets and
micro-batches first), and a stage holds at most ``cap[s]`` micro-batches between forward and
backward (by default :func:`stage_caps`: 1F1B's ``P - s``, now across subnet boundaries;
with the split, ``P`` on every stage, ZB-H1's rule: any stage may hold what 1F1B's first one
holds; with an :class:`ActivationCap`, a byte budget per stage instead: as many micro-batches as
their activations fit, so a stage holds more of the subnets whose activations there are small).
With ``split``,
each backward is two actions (zero-bubble pipelines, Qi et al. 2024): ``B``, the input gradient
the stage before waits for, chosen as above, and ``W``, the weight gradient nobody waits for but
the subnet's update, run only when nothing else is ready on its stage (so it never delays a ready
forward or backward; a micro-batch holds its slot until its ``W``). A subnet whose
forward still waits further down for an earlier subnet runs ahead on a stage one micro-batch at
a time, never in its only slot, so the slots stay with the subnets that can get through: no
deadlock, no clogged pipeline. The estimates only choose the order: the order is then a fixed
schedule that the executor runs with real waits, so a wrong estimate costs bubble, never
correctness. Pure: values in, values out; every rank computes the same schedule from the same
inputs without a message.

    P=2, M=2, two subnets that share no op, window 2 (``a@t``: subnet ``t``)::

        stage 0 |  0F0  0F1  0B0  0F0@1  0B1  0U  0F1@1  0B0@1  0B1@1  0U@1
        stage 1 |  1F0  1B0  1F1  1B1  1U  1F0@1  1B0@1  1F1@1  1B1@1  1U@1
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .clock import Clock
from .schedule import Action, Schedule, ScheduleError, WaitRule
from .values import SubnetWork

__all__ = ["ActivationCap", "ArenaBound", "SubnetWork", "cross_subnet", "flushed", "in_flight_bound", "sequential", "stage_caps"]

_PRIORITY = {"U": 0, "B": 1, "F": 2, "W": 3}


@dataclass(frozen=True)
class ArenaBound:
    """The tensor manager's device arena per stage (``capacity``, bytes) and the bytes each op
    with state takes there (``footprint``): a subnet begins on a stage only when its ops fit
    beside those of the subnets in flight there (the manager pins a subnet's ops from its first
    forward to its update)."""

    capacity: tuple[int, ...]
    footprint: Mapping[str, int]

    def bytes_of(self, ops) -> int:
        return sum(self.footprint.get(op, 0) for op in ops)


@dataclass(frozen=True)
class ActivationCap:
    """The activations a stage may hold between forwards and their backwards (their weight
    gradients, when split), in bytes rather than micro-batches: ``capacity[s]`` per stage and
    ``per_microbatch[t][s]``, what one micro-batch of subnet ``t`` keeps on stage ``s``. A
    forward may start when its micro-batch fits beside those held (a stage holding none takes
    any one: the planner checks that a lone micro-batch fits). :meth:`like` gives every stage
    the bytes that a cap of so many micro-batches would need for the subnet that keeps the most
    there: the same peak as that count cap, with more micro-batches held for the lighter subnets.
    Subnets of equal footprints there get exactly the count cap's schedule."""

    capacity: tuple[int, ...]
    per_microbatch: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", tuple(self.capacity))
        object.__setattr__(self, "per_microbatch", tuple(tuple(row) for row in self.per_microbatch))
        P = len(self.capacity)
        for name, values in (("capacity", self.capacity), *((f"per_microbatch[{t}]", row)
                                                           for t, row in enumerate(self.per_microbatch))):
            # whole bytes: the builder adds and subtracts them, and must not drift off the cap
            if len(values) != P or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ScheduleError(f"ActivationCap.{name}: expected {P} whole byte counts >= 0 (one per stage), "
                                    f"found {values!r:.120}")

    @classmethod
    def like(cls, counts: Sequence[int], per_microbatch: Sequence[Sequence[int]]) -> "ActivationCap":
        """The byte cap with the peak of the count cap ``counts`` (micro-batches per stage)."""
        P = len(counts)
        rows = [tuple(r) for r in per_microbatch]
        if not rows or any(len(r) != P for r in rows):
            raise ScheduleError(f"ActivationCap.like: expected a row of {P} byte counts per subnet, found "
                                f"{[len(r) for r in rows]}")
        return cls(tuple(c * max(r[s] for r in rows) for s, c in enumerate(counts)), tuple(rows))


def cross_subnet(work: Sequence[SubnetWork], num_microbatches: int, window: int, *,
                 frozen: frozenset[str] = frozenset(), delayed: frozenset[str] = frozenset(), delay: int = 0,
                 origin: Mapping[str, int] | None = None, state_time: Mapping[str, float] | None = None,
                 cap: Sequence[int] | None = None, name: str = "cross", arena: ArenaBound | None = None,
                 split: bool = False, delays: Mapping[str, int] | None = None,
                 activations: ActivationCap | None = None, norms: bool = False) -> Schedule:
    """The schedule of ``work`` (subnets in training order) with at most ``window`` unfinished.

    ``state_time[op]``: seconds an op's move takes (default 0); ``origin``: each op's stage
    before the first action; ``arena``: the tensor manager's bound (None: every op resident);
    ``split``: split every backward into ``B`` (input gradient) and ``W`` (weight gradient,
    ``SubnetWork.bwd_weight`` seconds), each ``W`` run where its stage would otherwise idle;
    ``delays``: a delayed op's own delay where not ``delay`` (:class:`Schedule`); ``activations``:
    a byte cap per stage in place of ``cap``'s micro-batch counts (``cap`` then only says which
    stages hold more than one micro-batch: the rule for subnets that run ahead); ``norms``: each
    update clips to a global gradient norm, so it waits for every stage's sums of squares
    (:class:`Schedule`). Raises :class:`ScheduleError` for inputs of the wrong shape.
    """
    return _admit(work, num_microbatches, window, frozen=frozen, delayed=delayed, delay=delay, origin=origin,
                  state_time=state_time, cap=cap, name=name, arena=arena, split=split, delays=delays,
                  activations=activations, norms=norms)[0]


def sequential(base: Schedule, uses: Sequence[Sequence[frozenset[str]]], *, frozen: frozenset[str] = frozenset(),
               delayed: frozenset[str] = frozenset(), delay: int = 0, origin: Mapping[str, int] | None = None,
               name: str | None = None, delays: Mapping[str, int] | None = None, norms: bool = False) -> Schedule:
    """Flushed steps back to back: subnet ``t`` runs the one-subnet schedule ``base`` (GPipe,
    1F1B) and then its update ``U`` on every stage, before the stage begins subnet ``t + 1``.
    Each update waits for the last stage's losses, so a subnet drains before the next begins:
    today's step, per subnet, with the moves the wait rule implies between them (``norms``: the
    updates clip, :class:`Schedule`)::

        P=2, M=2, 1F1B, two subnets
        stage 0 |  0F0  0F1  0B0  0B1  0U  0F0@1  0F1@1  0B0@1  0B1@1  0U@1
        stage 1 |  1F0  1B0  1F1  1B1  1U  1F0@1  1B0@1  1F1@1  1B1@1  1U@1
    """
    if base.updates or not base.training or base.num_subnets != 1:
        raise ScheduleError(f"sequential: expected a one-subnet training schedule without updates, found "
                            f"{base.name!r}")
    P, T = base.num_stages, len(uses)
    rows: list[list[Action]] = [[] for _ in range(P)]
    for t in range(T):
        for s in range(P):
            rows[s] += [Action(a.stage, a.kind, a.microbatch, t) for a in base.actions[s]]
            rows[s].append(Action(s, "U", 0, t))
    return Schedule(name or f"{base.name}+U", P, base.num_microbatches, tuple(tuple(r) for r in rows),
                    num_subnets=T, uses=tuple(tuple(u) for u in uses), frozen=frozenset(frozen),
                    delayed=frozenset(delayed), delay=delay, delays=tuple(sorted((delays or {}).items())),
                    origin=tuple(sorted(origin.items())) if origin is not None else None, norms=norms)


def _admit(work: Sequence[SubnetWork], num_microbatches: int, window: int, *, frozen: frozenset[str],
           delayed: frozenset[str], delay: int, origin: Mapping[str, int] | None,
           state_time: Mapping[str, float] | None, cap: Sequence[int] | None, name: str,
           arena: ArenaBound | None = None, split: bool = False,
           delays: Mapping[str, int] | None = None,
           activations: ActivationCap | None = None, norms: bool = False) -> tuple[Schedule, Clock]:
    """:func:`cross_subnet`, and the clock that timed its choices (the builder's estimates)."""
    if not work:
        raise ScheduleError("cross_subnet: expected at least one subnet, found none")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ScheduleError(f"pipeline.window: expected an int >= 1, found {window!r}")
    T, P, M = len(work), len(work[0].uses), num_microbatches
    if any(len(w.uses) != P for w in work):
        raise ScheduleError(f"cross_subnet: every subnet needs {P} stages, found {[len(w.uses) for w in work]}")
    cap = tuple(cap) if cap is not None else stage_caps(P, split)
    if len(cap) != P or any(c < 1 for c in cap):
        raise ScheduleError(f"cross_subnet: cap expected {P} values >= 1, found {cap!r}")
    if activations is not None and (len(activations.capacity) != P or len(activations.per_microbatch) != T):
        raise ScheduleError(f"cross_subnet: activations expected {T} subnets x {P} stages, found "
                            f"{len(activations.per_microbatch)} x {len(activations.capacity)}")
    uses = tuple(w.uses for w in work)
    rule = WaitRule(P, M, T, uses, frozenset(frozen), frozenset(delayed), delay,
                    dict(origin) if origin is not None else None, updates=True,
                    split=[(t, s) for t in range(T) for s in range(P)] if split else (), delays=delays, norms=norms)
    # the simulator's clock: an estimate here is exactly what simulate() replays of the result
    clock = Clock.per_subnet(rule, work, state_time)
    ids = [[[clock.id(Action(s, k, m, t)) for k in "FB" for m in range(M)] + [clock.id(Action(s, "U", 0, t))]
            + ([clock.id(Action(s, "W", m, t)) for m in range(M)] if split else [])
            for t in range(T)] for s in range(P)]  # per stage and subnet: F0..F(M-1), B0..B(M-1), U, W0..W(M-1)
    acts = clock.net.actions
    order = {i: (_PRIORITY[acts[i].kind], acts[i].subnet, acts[i].microbatch) for i in range(len(acts))}.__getitem__
    rows: list[list[Action]] = [[] for _ in range(P)]
    nf = [[0] * T for _ in range(P)]  # the next forward's micro-batch, per stage and subnet
    nb = [[0] * T for _ in range(P)]
    nw = [[0] * T for _ in range(P)] if split else nb  # the next weight gradient's (unsplit: none to run)
    updated = [[False] * T for _ in range(P)]
    live = [0] * P  # micro-batches between forward and backward (its weight gradient when split)
    held = [0] * P  # their activations' bytes (with an ActivationCap)
    done_stages = [0] * T
    lo = 0  # the oldest unfinished subnet

    # A subnet whose forward still waits further down for an earlier subnet's update may run
    # ahead on a stage one micro-batch at a time, never in the stage's only slot: its
    # micro-batches would hold the slots that the subnets ahead of it need there (a deadlock
    # when they all do, a clogged pipeline when most do). Those ahead always get a slot, and
    # the oldest subnet's way is always clear, so it always gets through.
    gates: dict[tuple[int, int], tuple[int, ...]] = {}

    def gate(t: int, s: int) -> tuple[int, ...]:
        """The earlier subnets' actions that subnet ``t``'s first forward on stage ``s`` waits for."""
        key = (t, s)
        if key not in gates:
            gates[key] = tuple(clock.id(w.action) for w in rule.waits(Action(s, "F", 0, t))
                               if w.action is not None and w.action.subnet != t)
        return gates[key]

    deepest: dict[int, int] = {}  # per subnet, the last stage its forward waits at (this round)

    def blocked(t: int, s: int) -> bool:
        """Whether subnet ``t``'s forward still waits past stage ``s`` for an earlier subnet."""
        d = deepest.get(t)
        if d is None:
            d = deepest[t] = max((s2 for s2 in range(P) if nf[s2][t] == 0
                                  and any(clock.end[j] is None for j in gate(t, s2))), default=-1)
        return d > s

    def room(t: int, s: int) -> bool:
        """Under an arena bound: subnet ``t`` may begin on stage ``s`` once every earlier subnet
        has begun there (so none it waits for is kept out) and its ops fit beside those in
        flight there, or nothing else is in flight (a lone subnet's fit is the planner's check)."""
        if arena is None or nf[s][t] > 0:
            return True
        if any(nf[s][u] == 0 for u in range(lo, t)):
            return False
        flight = [u for u in range(lo, t) if not updated[s][u]]
        pinned = frozenset().union(uses[t][s], *(uses[u][s] for u in flight))
        return not flight or arena.bytes_of(pinned) <= arena.capacity[s]

    def slot(t: int, s: int) -> bool:
        """Whether a micro-batch of subnet ``t`` may begin on stage ``s``: under the count cap
        or, with an :class:`ActivationCap`, its activations fit beside those held (a stage holding
        none takes any)."""
        if activations is None:
            return live[s] < cap[s]
        return live[s] == 0 or held[s] + activations.per_microbatch[t][s] <= activations.capacity[s]

    def candidates(s: int) -> list[int]:
        out = []
        admitted = range(lo, min(T, lo + window))
        ahead: bool | None = None  # may a subnet that waits further down run ahead on this stage?
        for t in admitted:
            f, b = nf[s][t], nb[s][t]
            if f < M and slot(t, s) and room(t, s):
                if blocked(t, s):
                    if ahead is None:
                        ahead = cap[s] > 1 and not any(nf[s][u] > nw[s][u] and blocked(u, s) for u in admitted)
                    if ahead:
                        out.append(ids[s][t][f])
                else:
                    out.append(ids[s][t][f])
            if b < f:
                out.append(ids[s][t][M + b])
            elif nw[s][t] == M and not updated[s][t]:
                out.append(ids[s][t][2 * M])
        return out

    def fill(s: int) -> int | None:
        """The weight gradient stage ``s`` runs when nothing else is ready there: the oldest
        subnet's next one (each subnet's in micro-batch order; its B ran on this stage, so it
        is ready now)."""
        for t in range(lo, min(T, lo + window)):
            if nw[s][t] < nb[s][t]:
                return ids[s][t][2 * M + 1 + nw[s][t]]
        return None

    remaining = T * P * (2 * M + 1 + (M if split else 0))
    while remaining:
        best: tuple[float, int, int] | None = None
        deepest.clear()
        for s in range(P):
            cands = [(i, r) for i in candidates(s) if (r := clock.ready(i)) is not None]
            w = fill(s) if split else None
            if w is not None and (not cands or min(r for _, r in cands) > clock.free[s]):
                # free work: the stage would idle now, so no forward or backward that is ready waits for it
                if best is None or clock.free[s] < best[0]:
                    best = (clock.free[s], s, w)
                continue
            if not cands:
                continue
            start = max(clock.free[s], min(r for _, r in cands))
            if best is None or start < best[0]:
                best = (start, s, min((i for i, r in cands if r <= start), key=order))
        if best is None:  # the rule's waits all point at earlier subnets: cannot happen
            raise ScheduleError(f"cross_subnet: no stage can progress with {remaining} actions left (window {window})")
        _, s, i = best
        clock.run((i,))  # starts at max(free, ready): the start chosen above
        a = acts[i]
        rows[s].append(a)
        remaining -= 1
        kept = activations.per_microbatch[a.subnet][s] if activations is not None else 0
        if a.kind == "F":
            nf[s][a.subnet] += 1
            live[s] += 1
            held[s] += kept
        elif a.kind == "B":
            nb[s][a.subnet] += 1
            if not split:
                live[s] -= 1
                held[s] -= kept
        elif a.kind == "W":
            nw[s][a.subnet] += 1
            live[s] -= 1
            held[s] -= kept
        else:
            updated[s][a.subnet] = True
            done_stages[a.subnet] += 1
            while lo < T and done_stages[lo] == P:
                lo += 1
    sched = Schedule(name, P, M, tuple(tuple(r) for r in rows), num_subnets=T, uses=uses,
                     frozen=frozenset(frozen), delayed=frozenset(delayed), delay=delay,
                     delays=tuple(sorted((delays or {}).items())),
                     origin=tuple(sorted(origin.items())) if origin is not None else None, norms=norms)
    return sched, clock


def stage_caps(num_stages: int, split: bool = False) -> tuple[int, ...]:
    """The builder's default cap per stage: ``P - s`` (1F1B's), or ``P`` on every stage with the
    B/W ``split`` (ZB-H1's rule: a micro-batch is held until its W, and each stage may hold what
    1F1B's first stage does: the same peak over the stages)."""
    return tuple(num_stages if split else num_stages - s for s in range(num_stages))


def in_flight_bound(num_stages: int, num_microbatches: int, window: int, split: bool = False) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations a cross-subnet schedule holds: the
    builder's cap (:func:`stage_caps`), and no more than ``window`` subnets' ``M`` each (what
    the partitioner's and the activation plan's memory model count)."""
    return tuple(min(c, window * num_microbatches) for c in stage_caps(num_stages, split))


def flushed(work: Sequence[SubnetWork], num_microbatches: int, **kw) -> Schedule:
    """Today's step as a cross-subnet schedule: one subnet at a time, drained before the next."""
    return cross_subnet(work, num_microbatches, 1, **kw)
