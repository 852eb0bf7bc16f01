"""The pipeline simulator: the timeline, makespan, bubble and peak memory of a schedule under given costs.

Model (pure; values in, values out):

* Each stage runs its actions one at a time, in schedule order. An action starts when its stage
  is free and its input message has arrived, and runs for ``fwd_time[s]`` or ``bwd_time[s]``.
* Sends are asynchronous: they never occupy the sending stage. Each cut ``c`` (between stage
  ``c`` and ``c + 1``) is a full-duplex link: the activation direction and the gradient direction
  are two independent FIFO resources. A transfer starts when its sender action ends and the
  previous transfer in the same direction has finished, and takes ``send_time[c]`` (activations)
  or ``grad_send_time[c]`` (gradients; defaults to ``send_time``). So back-to-back sends queue on
  the link instead of overlapping.
* Memory: a micro-batch's activations are held from the start of its F to the end of its B on
  that stage; peak memory is ``static_bytes[s] + peak_in_flight[s] * act_bytes[s]``, with the
  peak taken over the simulated timeline (same-instant events in action order).
* Host channels (only when ``copies`` are given, with :class:`HostLinks`): each stage has a
  host-to-device (``h2d``) and a device-to-host (``d2h``) direction of its host link, and a
  ``host`` channel for work the host does for it (the optimizer update of state kept in host
  memory). Each is a FIFO resource: a :class:`Copy` starts when its channel is free, at or after
  its ``ready`` time, after the action it follows (``after``) and after the earlier copies it
  ``waits_for``, and takes ``nbytes / rate``. An action that a copy must precede (``before``)
  waits for it: that wait is the stage's *stall*, and it shifts everything after it. Channels
  start free at ``HostLinks.*_free_at`` (a previous step's backlog, on this step's clock).

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schedule import Action, Schedule, validate

__all__ = ["Span", "SimResult", "SimulationError", "Copy", "CopySpan", "HostLinks", "CHANNELS", "makespan", "simulate"]

CHANNELS = ("h2d", "d2h", "host")


class SimulationError(ValueError):
    """The simulator was given costs that do not fit the schedule."""


@dataclass(frozen=True)
class Span:
    """One action's place on the timeline."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step looks like.

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


@dataclass(frozen=True)
class Copy:
    """One job on a stage's host channel (``channel``: ``h2d``, ``d2h`` or ``host``).

    ``ready``: earliest start on the step's clock (negative: issued during the step before).
    ``after``: an action of this step the copy follows (a write-back of grads after the last
    backward). ``before``: the action that needs it (an op's fetch before the stage's first
    forward). ``waits_for``: indices of earlier copies that must end first (a fetch into the
    space of an evicted op after its write-back; a weight fetch after the host's update)."""

    stage: int
    channel: str
    nbytes: float
    ready: float = -math.inf
    after: Action | None = None
    before: Action | None = None
    waits_for: tuple[int, ...] = ()
    label: str = ""


@dataclass(frozen=True)
class CopySpan:
    copy: Copy
    start: float
    end: float


@dataclass(frozen=True)
class HostLinks:
    """Per stage: the host link's rate each way (bytes/s) and the host's update rate (bytes of
    parameters per second; None: no host work). ``*_free_at``: when each channel is next free on
    the step's clock (default: free)."""

    h2d: tuple[float, ...]
    d2h: tuple[float, ...]
    host: tuple[float, ...] | None = None
    h2d_free_at: tuple[float, ...] | None = None
    d2h_free_at: tuple[float, ...] | None = None
    host_free_at: tuple[float, ...] | None = None

    def rate(self, channel: str, stage: int) -> float:
        rates = {"h2d": self.h2d, "d2h": self.d2h, "host": self.host}[channel]
        if rates is None:
            raise SimulationError(f"copy on channel {channel!r} of stage {stage}: HostLinks.host is None; "
                                  "expected a host update rate per stage")
        return rates[stage]


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


def _peak_live(spans: tuple[Span, ...]) -> int:
    """The most micro-batches held at once: +1 at each F start, -1 at each B end.

    Events at the same instant are taken in action order, so a B that ends as the next F
    starts frees first, and a zero-length F then B of one micro-batch still counts it.
    """
    if not spans:
        return 0
    is_f = np.array([sp.action.kind == "F" for sp in spans])
    times = np.array([sp.start if f else sp.end for sp, f in zip(spans, is_f)])
    deltas = np.where(is_f, 1, -1)
    order = np.lexsort((np.arange(len(spans)), times))
    return int(max(0, np.cumsum(deltas[order]).max()))


def simulate(
    schedule: Schedule,
    fwd_time: Sequence[float],
    bwd_time: Sequence[float],
    send_time: Sequence[float],
    grad_send_time: Sequence[float] | None = None,
    static_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    copies: Sequence[Copy] | None = None,
    links: HostLinks | None = None,
) -> SimResult:
    """Simulate one step of ``schedule``; costs are per stage (per micro-batch) and per cut.

    ``send_time`` and ``grad_send_time`` have ``P - 1`` entries (cut ``c`` joins stage ``c`` and
    ``c + 1``). ``copies`` (with ``links``): jobs on the stages' host channels (module doc); without
    them the result is the same as before channels existed. Raises :class:`ScheduleError` for an
    invalid schedule and :class:`SimulationError` for costs of the wrong shape.
    """
    _validate_once(schedule)
    P = schedule.num_stages
    fwd = _per("fwd_time", fwd_time, P, "stage")
    bwd = _per("bwd_time", bwd_time, P, "stage")
    send = _per("send_time", send_time, P - 1, "cut between stages")
    gsend = send if grad_send_time is None else _per("grad_send_time", grad_send_time, P - 1, "cut")
    with_memory = static_bytes is not None or act_bytes is not None
    static = _per("static_bytes", static_bytes, P, "stage")
    act = _per("act_bytes", act_bytes, P, "stage")

    if copies is None:
        timeline = _replay(schedule, fwd, bwd, send, gsend, record=True)
        extra: dict = {}
    else:
        timeline, extra = _replay_copies(schedule, fwd, bwd, send, gsend, _check_copies(schedule, copies, links), links)
    step_time = max((sp.end for row in timeline for sp in row), default=0.0)
    busy = tuple(sum(sp.end - sp.start for sp in row) for row in timeline)
    bubble = 1.0 - sum(busy) / (P * step_time) if step_time > 0 else 0.0
    if schedule.training:
        peaks = tuple(_peak_live(row) for row in timeline)
    else:
        peaks = (0,) * P  # nothing is kept for a backward
    memory = tuple(static[s] + peaks[s] * act[s] for s in range(P)) if with_memory else None
    return SimResult(step_time, busy, timeline, bubble, peaks, memory, **extra)


_VALIDATED: dict[int, Schedule] = {}


def _validate_once(schedule: Schedule) -> None:
    """:func:`validate`, once per schedule object (schedules are frozen): a bench replaying
    thousands of steps of one schedule would otherwise spend half its time re-checking it."""
    if _VALIDATED.get(id(schedule)) is schedule:
        return
    validate(schedule)
    if len(_VALIDATED) >= 64:
        _VALIDATED.clear()
    _VALIDATED[id(schedule)] = schedule  # holds the object, so its id is not reused meanwhile


def _check_copies(schedule: Schedule, copies: Sequence[Copy], links: HostLinks | None) -> tuple[Copy, ...]:
    P = schedule.num_stages
    if not isinstance(links, HostLinks):
        raise SimulationError(f"links: expected HostLinks with copies, found {links!r}")
    for name in ("h2d", "d2h", "host", "h2d_free_at", "d2h_free_at", "host_free_at"):
        v = getattr(links, name)
        if v is not None and len(v) != P:
            raise SimulationError(f"HostLinks.{name}: expected {P} values (one per stage), found {len(v)}")
    for name in ("h2d", "d2h", "host"):
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


def _replay_copies(schedule: Schedule, fwd, bwd, send, gsend, copies: tuple[Copy, ...], links: HostLinks):
    """The event replay of :func:`_replay` with the host channels: actions wait for the copies
    that precede them, copies for the actions and copies they follow, each channel in order."""
    P = schedule.num_stages
    arrival: dict[tuple[int, str, int], float] = {}
    act_link = [0.0] * max(P - 1, 0)
    grad_link = [0.0] * max(P - 1, 0)
    free = [0.0] * P
    pos = [0] * P
    spans: list[list[Span]] = [[] for _ in range(P)]
    ended: dict[Action, float] = {}
    stall = [0.0] * P
    chan_free = {ch: list(getattr(links, f"{ch}_free_at") or (-math.inf,) * P) for ch in CHANNELS}
    queues: dict[tuple[str, int], list[int]] = {}
    needs: dict[Action, list[int]] = {}
    for k, c in enumerate(copies):
        queues.setdefault((c.channel, c.stage), []).append(k)
        if c.before is not None:
            needs.setdefault(c.before, []).append(k)
    qpos = {q: 0 for q in queues}
    done: list[tuple[float, float] | None] = [None] * len(copies)
    remaining = sum(len(row) for row in schedule.actions) + len(copies)
    while remaining:
        progressed = False
        for (ch, st), idx in queues.items():  # copies, each channel in order
            while qpos[(ch, st)] < len(idx):
                k = idx[qpos[(ch, st)]]
                c = copies[k]
                if (c.after is not None and c.after not in ended) or any(done[w] is None for w in c.waits_for):
                    break
                start = max(chan_free[ch][st], c.ready, ended.get(c.after, -math.inf),
                            *(done[w][1] for w in c.waits_for))
                start = max(start, 0.0) if math.isinf(start) else start
                end = start + c.nbytes / links.rate(ch, st)
                chan_free[ch][st] = end
                done[k] = (start, end)
                qpos[(ch, st)] += 1
                remaining -= 1
                progressed = True
        for s in range(P):
            row = schedule.actions[s]
            while pos[s] < len(row):
                a = row[pos[s]]
                needs_msg = (a.kind == "F" and s > 0) or (a.kind == "B" and s < P - 1)
                key = (s, a.kind, a.microbatch)
                if needs_msg and key not in arrival:
                    break
                waits = needs.get(a, ())
                if any(done[k] is None for k in waits):
                    break
                could = max(free[s], arrival.get(key, 0.0))
                start = max(could, *(done[k][1] for k in waits)) if waits else could
                stall[s] += start - could
                end = start + (fwd[s] if a.kind == "F" else bwd[s])
                free[s] = end
                ended[a] = end
                spans[s].append(Span(a, start, end))
                if a.kind == "F" and s < P - 1:
                    act_link[s] = max(end, act_link[s]) + send[s]
                    arrival[(s + 1, "F", a.microbatch)] = act_link[s]
                elif a.kind == "B" and s > 0:
                    grad_link[s - 1] = max(end, grad_link[s - 1]) + gsend[s - 1]
                    arrival[(s - 1, "B", a.microbatch)] = grad_link[s - 1]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"{copies[idx[qpos[q]]].label or idx[qpos[q]]} on {q[0]}[{q[1]}]"
                     for q, idx in queues.items() if qpos[q] < len(idx)]
            raise SimulationError(f"simulate: copies and actions wait for each other (a copy after an action "
                                  f"that needs it?): stages at {pos}, copies waiting: {stuck}")
    spans_out = tuple(CopySpan(c, *done[k]) for k, c in enumerate(copies))
    free_at = {ch: tuple(chan_free[ch]) for ch in CHANNELS}
    return tuple(tuple(row) for row in spans), dict(copies=spans_out, stall=tuple(stall), free_at=free_at)


def _replay(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float],
            gsend: Sequence[float], record: bool):
    """The event replay shared by :func:`simulate` (``record``: every action's span) and
    :func:`makespan` (only the end time). The schedule must be valid."""
    P = schedule.num_stages
    # arrival[(receiving stage, kind, microbatch)] = when the message is there
    arrival: dict[tuple[int, str, int], float] = {}
    act_link = [0.0] * max(P - 1, 0)   # when cut c's forward direction is next free
    grad_link = [0.0] * max(P - 1, 0)  # when cut c's backward direction is next free
    free = [0.0] * P
    pos = [0] * P
    spans: list[list[Span]] = [[] for _ in range(P)]
    remaining = sum(len(row) for row in schedule.actions)
    while remaining:
        progressed = False
        for s in range(P):
            row = schedule.actions[s]
            while pos[s] < len(row):
                a = row[pos[s]]
                needs_msg = (a.kind == "F" and s > 0) or (a.kind == "B" and s < P - 1)
                key = (s, a.kind, a.microbatch)
                if needs_msg and key not in arrival:
                    break
                start = max(free[s], arrival.get(key, 0.0))
                end = start + (fwd[s] if a.kind == "F" else bwd[s])
                free[s] = end
                if record:
                    spans[s].append(Span(a, start, end))
                if a.kind == "F" and s < P - 1:
                    act_link[s] = max(end, act_link[s]) + send[s]
                    arrival[(s + 1, "F", a.microbatch)] = act_link[s]
                elif a.kind == "B" and s > 0:
                    grad_link[s - 1] = max(end, grad_link[s - 1]) + gsend[s - 1]
                    arrival[(s - 1, "B", a.microbatch)] = grad_link[s - 1]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # validate() rules this out; never loop forever on a bug
            raise SimulationError(f"simulate: no stage could progress at positions {pos}")

    if record:
        return tuple(tuple(row) for row in spans)
    return max(free, default=0.0)


def makespan(schedule: Schedule, fwd_time: Sequence[float], bwd_time: Sequence[float],
             send_time: Sequence[float], grad_send_time: Sequence[float] | None = None) -> float:
    """:func:`simulate`'s ``step_time`` without validation or a timeline: fast enough for a
    planner to score candidate partitions. ``schedule`` must be valid (the builders' are)."""
    return _replay(schedule, fwd_time, bwd_time, send_time,
                   send_time if grad_send_time is None else grad_send_time, record=False)
