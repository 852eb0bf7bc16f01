"""The pipeline simulator: the timeline, makespan, bubble and peak memory of a schedule under given costs.

Model (pure; values in, values out):

* Each stage runs its actions one at a time, in schedule order. An action starts when its stage
  is free and everything it waits for has arrived — what that is, the schedule's
  :class:`~pipeline.plan.schedule.WaitRule` says (the one definition the validator, the admission
  builder and the executor use too) — and runs for its cost: the forward or backward of one
  micro-batch, or an update ``U``. A split backward (the schedule lists a ``W`` per micro-batch
  of that subnet and stage) is two actions: ``B`` takes the backward less its weight gradient,
  ``W`` the weight gradient (``bwd_weight_time`` per stage, ``SubnetWork.bwd_weight`` per
  subnet; default half the backward, :data:`~pipeline.plan.clock.WEIGHT_SHARE`).
* Sends are asynchronous: they never occupy the sending stage. Each cut ``c`` (between stage
  ``c`` and ``c + 1``) is a full-duplex link: the activation direction and the gradient direction
  are two independent FIFO resources. A transfer starts when its sender action ends and the
  previous transfer in the same direction has finished, and takes ``send_time[c]`` (activations)
  or ``grad_send_time[c]`` (gradients; defaults to ``send_time``). So back-to-back sends queue on
  the link instead of overlapping. A subnet's losses reach every stage when the last stage's
  update ends (a few numbers: no cost); an op's state reaches its new stage ``state_time[op]``
  after the update it follows (moves go point to point, beside the cut links).
* Costs are per stage (``fwd_time``, ``bwd_time``, ``send_time``: every subnet alike, updates
  and moves free, as a one-subnet step has always been simulated) or per subnet (``work``: one
  :class:`~pipeline.plan.admission.SubnetWork` per subnet of a cross-subnet schedule, with its
  own forward, backward, send and update seconds, and ``state_time`` per op).
* Memory: a micro-batch's activations are held from the start of its F to the end of its B on
  that stage (of its W when split: W needs B's record); peak memory is ``static_bytes[s] +
  peak_in_flight[s] * act_bytes[s]``, with the peak taken over the simulated timeline
  (same-instant events in action order).
* Host channels (only when ``copies`` are given, with :class:`HostLinks`): each stage has a
  host-to-device (``h2d``) and a device-to-host (``d2h``) direction of its host link, and a
  ``host`` channel for work the host does for it (the optimizer update of state kept in host
  memory). Each is a FIFO resource: a :class:`Copy` starts when its channel is free, at or after
  its ``ready`` time, after the action it follows (``after``) and after the earlier copies it
  ``waits_for``, and takes ``nbytes / rate``. An action that a copy must precede (``before``)
  waits for it: that wait is the stage's *stall*, and it shifts everything after it. Channels
  start free at ``HostLinks.*_free_at`` (a previous step's backlog, on this step's clock).
  The peer link (:mod:`pipeline.plan.activations`' peer tier) is two more channels of the giving
  stage, ``peer_out`` (activations to its paired stage after a forward) and ``peer_in`` (back
  before the backward), at ``HostLinks.peer_out`` / ``peer_in`` bytes/s.

One event loop (:class:`Clock`) times everything: stages, links and host channels are FIFO
resources, and each action or copy starts when its resource is free and its inputs are there.
The simulator runs it over the schedule's lists; the admission builder runs the same clock one
chosen action at a time, so its estimates are exactly what this simulator replays.

What crosses the host link for an op of ``p`` fp32 parameters (AdamW), per the two placements of
the optimizer state that :mod:`bench.vtm` compares (the physics the tensor manager follows):

* optimizer state on the device (travels with the op): a fetch moves the weights and both AdamW
  moments, ``12 p`` bytes up (4 + 4 + 4); the grads (``4 p``) are made on the device in the
  backward and consumed by the device's update, so they never travel (``16 p`` resident while
  active); evicting an op whose state changed writes the same ``12 p`` back, a clean one nothing.
* optimizer state on the host (updated there): a use moves the weights, ``4 p`` up, and the grads,
  ``4 p`` down after the step's last backward; the host reads weights, grads and moments and
  writes weights and moments (``28 p`` bytes of host memory traffic) at the host's update rate;
  the device copy is stale after the update, so the next use fetches the weights again, after
  that update has ended.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .clock import Clock
from .schedule import Action, Schedule, validate
from .values import Copy, CopySpan, HostLinks, SimulationError, SubnetWork

__all__ = ["Span", "SimResult", "SimulationError", "Copy", "CopySpan", "HostLinks", "CHANNELS", "makespan",
           "simulate"]

CHANNELS = ("h2d", "d2h", "host", "peer_out", "peer_in")


@dataclass(frozen=True)
class Span:
    """One action's place on the timeline."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step (or a cross-subnet schedule's sequence of subnets) looks like.

    ``timeline[s]`` lists stage ``s``'s actions in the order they ran; ``peak_memory`` is None
    when no memory figures were given.
    """

    step_time: float
    busy: tuple[float, ...]
    timeline: tuple[tuple[Span, ...], ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_memory: tuple[float, ...] | None
    copies: tuple[CopySpan, ...] | None = None   # with ``copies``: each copy's place, in input order
    stall: tuple[float, ...] | None = None       # per stage: seconds its actions waited for copies
    free_at: dict[str, tuple[float, ...]] | None = None  # per channel and stage: when it is next free
    waited: dict[Action, float] | None = None    # with ``copies``: each action that waited for copies, seconds


def _per(name: str, values: Sequence[float] | None, n: int, what: str) -> tuple[float, ...]:
    if values is None:
        return (0.0,) * n
    values = tuple(float(v) for v in values)
    if len(values) != n:
        raise SimulationError(f"{name}: expected {n} values (one per {what}), found {len(values)}")
    for k, v in enumerate(values):
        if not (math.isfinite(v) and v >= 0):
            raise SimulationError(f"{name}[{k}]: expected a finite non-negative number, found {v}")
    return values


def _clock(schedule: Schedule, fwd_time, bwd_time, send_time, grad_send_time, work, state_time,
           check: bool, bwd_weight_time=None) -> Clock:
    """A fresh clock for ``schedule`` with its costs given per stage or per subnet (``work``)."""
    P, T = schedule.num_stages, schedule.num_subnets
    if work is not None:
        if any(x is not None for x in (fwd_time, bwd_time, send_time, grad_send_time, bwd_weight_time)):
            raise SimulationError("simulate: costs given twice; expected per-stage costs (fwd_time, bwd_time, "
                                  "send_time) or per-subnet costs (work), not both")
        if check:
            if len(work) != T:
                raise SimulationError(f"work: expected one SubnetWork per subnet of schedule {schedule.name!r} "
                                      f"({T}), found {len(work)}")
            for t, w in enumerate(work):
                if len(w.fwd) != P:
                    raise SimulationError(f"work[{t}]: expected costs for {P} stages, found {len(w.fwd)}")
            for op, v in (state_time or {}).items():
                if not (math.isfinite(v) and v >= 0):
                    raise SimulationError(f"state_time[{op!r}]: expected finite non-negative seconds, found {v}")
        return Clock.per_subnet(schedule.rule, work, state_time)
    if fwd_time is None or bwd_time is None or send_time is None:
        raise SimulationError("simulate: expected per-stage costs (fwd_time, bwd_time, send_time) or per-subnet "
                              "costs (work=[SubnetWork, ...]); found neither")
    if state_time:
        raise SimulationError("state_time: per-op move seconds go with per-subnet costs (work=...); per-stage costs "
                              "move ops for free")
    if check:
        fwd_time = _per("fwd_time", fwd_time, P, "stage")
        bwd_time = _per("bwd_time", bwd_time, P, "stage")
        send_time = _per("send_time", send_time, P - 1, "cut between stages")
        grad_send_time = None if grad_send_time is None else _per("grad_send_time", grad_send_time, P - 1, "cut")
        if bwd_weight_time is not None:
            bwd_weight_time = _per("bwd_weight_time", bwd_weight_time, P, "stage")
            for s, (w, b) in enumerate(zip(bwd_weight_time, bwd_time)):
                if w > b:
                    raise SimulationError(f"bwd_weight_time[{s}]: expected at most the backward's "
                                          f"{b} seconds (the weight gradient is part of it), found {w}")
    return Clock.per_stage(schedule.rule, fwd_time, bwd_time, send_time, grad_send_time, bwd_weight_time)


# per schedule (through its rule, which belongs to it alone), forgotten with it
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(schedule: Schedule) -> tuple[list[list[int]], list[int]]:
    """Each stage's list as task ids, and an order of them all that respects every wait:
    once per schedule object (schedules are frozen; a planner replays one thousands of times)."""
    hit = _PROGRAMS.get(schedule.rule)
    if hit is None:
        zeros = [0.0] * schedule.num_stages
        clock = Clock.per_stage(schedule.rule, zeros, zeros, zeros[1:])  # the order needs no costs
        rows = [[clock.id(a) for a in row] for row in schedule.actions]
        hit = _PROGRAMS[schedule.rule] = (rows, clock.order(rows))
    return hit


def _peak_live(spans: tuple[Span, ...], releases: Callable[[Action], bool]) -> int:
    """The most micro-batches held at once: +1 at each F start, -1 at the end of each action
    that ``releases`` its micro-batch (a B, or the W of a split backward).

    Events at the same instant are taken in action order, so a B that ends as the next F
    starts frees first, and a zero-length F then B of one micro-batch still counts it.
    """
    spans = tuple(sp for sp in spans if sp.action.kind == "F" or releases(sp.action))
    if not spans:
        return 0
    is_f = np.array([sp.action.kind == "F" for sp in spans])
    times = np.array([sp.start if f else sp.end for sp, f in zip(spans, is_f)])
    deltas = np.where(is_f, 1, -1)
    order = np.lexsort((np.arange(len(spans)), times))
    return int(max(0, np.cumsum(deltas[order]).max()))


def simulate(
    schedule: Schedule,
    fwd_time: Sequence[float] | None = None,
    bwd_time: Sequence[float] | None = None,
    send_time: Sequence[float] | None = None,
    grad_send_time: Sequence[float] | None = None,
    static_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    copies: Sequence[Copy] | None = None,
    links: HostLinks | None = None,
    *,
    work: Sequence[SubnetWork] | None = None,
    state_time: Mapping[str, float] | None = None,
    bwd_weight_time: Sequence[float] | None = None,
) -> SimResult:
    """Simulate ``schedule`` (one step, or a cross-subnet schedule's whole sequence of subnets).

    Costs per stage (per micro-batch) and per cut: ``send_time`` and ``grad_send_time`` have
    ``P - 1`` entries (cut ``c`` joins stage ``c`` and ``c + 1``); every subnet alike, updates and
    moves free. Or per subnet: ``work`` (one :class:`~pipeline.plan.admission.SubnetWork` per
    subnet: forward, backward, update and send seconds) and ``state_time`` (op -> seconds its
    move takes). ``bwd_weight_time``: per stage, the seconds of a split backward's ``W`` (its
    ``B`` takes the rest of ``bwd_time``; default half). ``copies`` (with ``links``): jobs on
    the stages' host channels (module doc); without them the result is the same as before
    channels existed. Raises
    :class:`ScheduleError` for an invalid schedule and :class:`SimulationError` for costs of the
    wrong shape.
    """
    _validate_once(schedule)
    P = schedule.num_stages
    clock = _clock(schedule, fwd_time, bwd_time, send_time, grad_send_time, work, state_time, check=True,
                   bwd_weight_time=bwd_weight_time)
    with_memory = static_bytes is not None or act_bytes is not None
    static = _per("static_bytes", static_bytes, P, "stage")
    act = _per("act_bytes", act_bytes, P, "stage")
    rows, order = _program(schedule)
    extra: dict = {}
    if copies is None:
        clock.run(order)
    else:
        copies = _check_copies(schedule, copies, links)
        clock.run(clock.order(rows + clock.add_copies(copies, links)))
        n = len(clock.net.actions)
        free_at = {ch: tuple(clock.free[clock.channel[(ch, s)]] if (ch, s) in clock.channel
                             else (getattr(links, f"{ch}_free_at") or (-math.inf,) * P)[s] for s in range(P))
                   for ch in CHANNELS}
        extra = dict(copies=tuple(CopySpan(c, clock.start[n + k], clock.end[n + k]) for k, c in enumerate(copies)),
                     stall=tuple(clock.stall), free_at=free_at, waited=_waited(clock, schedule, rows))
    timeline = tuple(tuple(Span(a, clock.start[i], clock.end[i]) for a, i in zip(actions, ids))
                     for actions, ids in zip(schedule.actions, rows))
    step_time = max((sp.end for row in timeline for sp in row), default=0.0)
    busy = tuple(sum(sp.end - sp.start for sp in row) for row in timeline)
    bubble = 1.0 - sum(busy) / (P * step_time) if step_time > 0 else 0.0
    if schedule.training:
        peaks = tuple(_peak_live(row, schedule.releases) for row in timeline)
    else:
        peaks = (0,) * P  # nothing is kept for a backward
    memory = tuple(static[s] + peaks[s] * act[s] for s in range(P)) if with_memory else None
    return SimResult(step_time, busy, timeline, bubble, peaks, memory, **extra)


def _waited(clock: Clock, schedule: Schedule, rows: list[list[int]]) -> dict[Action, float]:
    """Per action that waited for host copies, the seconds it waited (each stage's ``stall`` split
    by action): its start less when its stage and its messages would have let it start."""
    out: dict[Action, float] = {}
    for actions, ids in zip(schedule.actions, rows):
        free = 0.0
        for a, i in zip(actions, ids):
            if clock.cdeps[i]:
                could = max([free, *(clock.arrive[k] for k in clock.deps[i])])
                if clock.start[i] > could:
                    out[a] = clock.start[i] - could
            free = clock.end[i]
    return out


def makespan(schedule: Schedule, fwd_time: Sequence[float] | None = None, bwd_time: Sequence[float] | None = None,
             send_time: Sequence[float] | None = None, grad_send_time: Sequence[float] | None = None, *,
             work: Sequence[SubnetWork] | None = None, state_time: Mapping[str, float] | None = None,
             bwd_weight_time: Sequence[float] | None = None) -> float:
    """:func:`simulate`'s ``step_time`` without validation or a timeline: fast enough for a
    planner to score candidate partitions. ``schedule`` must be valid (the builders' are)."""
    _, order = _program(schedule)
    clock = _clock(schedule, fwd_time, bwd_time, send_time, grad_send_time, work, state_time, check=False,
                   bwd_weight_time=bwd_weight_time)
    clock.run(order)
    return max(clock.free, default=0.0)


_VALIDATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _validate_once(schedule: Schedule) -> None:
    """:func:`validate`, once per schedule object (schedules are frozen; keyed by its rule,
    which belongs to it alone): a bench replaying thousands of steps of one schedule would
    otherwise spend half its time re-checking it."""
    if schedule.rule in _VALIDATED:
        return
    validate(schedule)
    _VALIDATED[schedule.rule] = True


def _check_copies(schedule: Schedule, copies: Sequence[Copy], links: HostLinks | None) -> tuple[Copy, ...]:
    P = schedule.num_stages
    if not isinstance(links, HostLinks):
        raise SimulationError(f"links: expected HostLinks with copies, found {links!r}")
    for name in (*CHANNELS, *(f"{ch}_free_at" for ch in CHANNELS)):
        v = getattr(links, name)
        if v is not None and len(v) != P:
            raise SimulationError(f"HostLinks.{name}: expected {P} values (one per stage), found {len(v)}")
    for name in CHANNELS:
        for k, r in enumerate(getattr(links, name) or ()):
            if not r > 0:
                raise SimulationError(f"HostLinks.{name}[{k}]: expected a positive rate (bytes/s), found {r}")
    actions = {a for row in schedule.actions for a in row}
    copies = tuple(copies)
    for k, c in enumerate(copies):
        if not isinstance(c, Copy):
            raise SimulationError(f"copies[{k}]: expected a Copy, found {c!r}")
        if c.channel not in CHANNELS:
            raise SimulationError(f"copies[{k}].channel: expected one of {list(CHANNELS)}, found {c.channel!r}")
        if not (isinstance(c.stage, int) and 0 <= c.stage < P):
            raise SimulationError(f"copies[{k}].stage: expected 0..{P - 1}, found {c.stage!r}")
        if not (math.isfinite(c.nbytes) and c.nbytes >= 0):
            raise SimulationError(f"copies[{k}].nbytes: expected a finite non-negative number, found {c.nbytes!r}")
        for name in ("after", "before"):
            a = getattr(c, name)
            if a is not None and a not in actions:
                raise SimulationError(f"copies[{k}].{name}: {a} is not an action of schedule {schedule.name!r}")
        for w in c.waits_for:
            if not (isinstance(w, int) and 0 <= w < k):
                raise SimulationError(f"copies[{k}].waits_for: expected indices of earlier copies (0..{k - 1}), "
                                      f"found {w!r}")
        links.rate(c.channel, c.stage)
    return copies
