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
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schedule import Action, Schedule, validate

__all__ = ["Span", "SimResult", "SimulationError", "makespan", "simulate"]


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
) -> SimResult:
    """Simulate one step of ``schedule``; costs are per stage (per micro-batch) and per cut.

    ``send_time`` and ``grad_send_time`` have ``P - 1`` entries (cut ``c`` joins stage ``c`` and
    ``c + 1``). Raises :class:`ScheduleError` for an invalid schedule and
    :class:`SimulationError` for costs of the wrong shape.
    """
    validate(schedule)
    P = schedule.num_stages
    fwd = _per("fwd_time", fwd_time, P, "stage")
    bwd = _per("bwd_time", bwd_time, P, "stage")
    send = _per("send_time", send_time, P - 1, "cut between stages")
    gsend = send if grad_send_time is None else _per("grad_send_time", grad_send_time, P - 1, "cut")
    with_memory = static_bytes is not None or act_bytes is not None
    static = _per("static_bytes", static_bytes, P, "stage")
    act = _per("act_bytes", act_bytes, P, "stage")

    timeline = _replay(schedule, fwd, bwd, send, gsend, record=True)
    step_time = max((sp.end for row in timeline for sp in row), default=0.0)
    busy = tuple(sum(sp.end - sp.start for sp in row) for row in timeline)
    bubble = 1.0 - sum(busy) / (P * step_time) if step_time > 0 else 0.0
    if schedule.training:
        peaks = tuple(_peak_live(row) for row in timeline)
    else:
        peaks = (0,) * P  # nothing is kept for a backward
    memory = tuple(static[s] + peaks[s] * act[s] for s in range(P)) if with_memory else None
    return SimResult(step_time, busy, timeline, bubble, peaks, memory)


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
