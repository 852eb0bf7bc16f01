"""Pipeline schedules as data: which forward/backward action each stage runs, in which order.

A :class:`Schedule` holds one tuple of :class:`Action` per stage (rank ``s`` runs stage ``s``).
Communication is implied by the actions, never listed:

* ``F(s, m)`` for ``s > 0`` receives micro-batch ``m``'s activation from stage ``s - 1``, and
  for ``s < P - 1`` sends its output to stage ``s + 1`` when it ends;
* ``B(s, m)`` for ``s < P - 1`` receives the gradient of ``m`` from stage ``s + 1``, and for
  ``s > 0`` sends the input gradient to stage ``s - 1`` when it ends; it needs ``F(s, m)`` to
  have run on the same stage.

Sends are asynchronous; a receive blocks until its message was sent. Each directed channel
(activations ``s -> s+1``, gradients ``s+1 -> s``) delivers messages in the order they were sent,
as NCCL point-to-point does, so the receiver must consume them in the sender's order.
Backwards run in ascending micro-batch order on every stage in every schedule: that order is the
gradient accumulation order, and fixing it fixes the floating-point sum whatever the schedule.

1F1B (PipeDream-flush) for P=3, M=4; stage ``s`` warms up with ``min(M, P - s - 1)`` forwards,
then alternates one forward and one backward, then drains the remaining backwards::

    step    |  0     1     2     3     4     5     6     7
    stage 0 |  0F0   0F1   0F2   0B0   0F3   0B1   0B2   0B3
    stage 1 |  1F0   1F1   1B0   1F2   1B1   1F3   1B2   1B3
    stage 2 |  2F0   2B0   2F1   2B1   2F2   2B2   2F3   2B3

Columns are positions in each stage's list, not clock ticks; :mod:`pipeline.plan.simulate` gives
the timed view. Everything here is pure: values in, values out.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULES",
    "gpipe", "one_f_one_b", "forward_only", "build",
    "in_flight", "max_in_flight", "validate", "format_grid",
]

KINDS = ("F", "B")
_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+)$")


class ScheduleError(ValueError):
    """A schedule is malformed, would mismatch messages, or would deadlock."""


@dataclass(frozen=True, order=True)
class Action:
    """Stage ``stage`` runs the forward (``"F"``) or backward (``"B"``) of one micro-batch."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        for name in ("stage", "microbatch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ScheduleError(f"Action.{name}: expected a non-negative int, found {v!r}")
        if self.kind not in KINDS:
            raise ScheduleError(f"Action.kind: expected one of {list(KINDS)}, found {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"1F0"`` back into ``Action(1, "F", 0)``."""
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"Action.parse: expected '<stage><F|B><microbatch>' such as '1F0' or '0B3', found {text!r}"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """One ordered tuple of actions per stage; ``training=False`` for forward-only schedules."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    training: bool = True

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ScheduleError(f"Schedule.{name}: expected a positive int, found {v!r}")
        actions = tuple(tuple(row) for row in self.actions)
        object.__setattr__(self, "actions", actions)
        if len(actions) != self.num_stages:
            raise ScheduleError(
                f"Schedule.actions: expected one row per stage ({self.num_stages}), found {len(actions)} rows"
            )
        for row in actions:
            for a in row:
                if not isinstance(a, Action):
                    raise ScheduleError(f"Schedule.actions: expected Action values, found {a!r}")

    def __str__(self) -> str:
        return format_grid(self)


# ---------------------------------------------------------------------------------- builders


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"{name}: expected a positive int, found {v!r}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward in order, then every backward in ascending micro-batch order."""
    _check_sizes(num_stages, num_microbatches)
    rows = tuple(
        tuple(Action(s, "F", m) for m in range(num_microbatches))
        + tuple(Action(s, "B", m) for m in range(num_microbatches))
        for s in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, rows)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush / Megatron): warm-up forwards, steady one-forward-one-backward, drain."""
    _check_sizes(num_stages, num_microbatches)
    P, M = num_stages, num_microbatches
    rows = []
    for s in range(P):
        warm = min(M, P - s - 1)
        row = [Action(s, "F", m) for m in range(warm)]
        for k in range(M - warm):  # steady state: the next forward, then the oldest backward
            row += [Action(s, "F", warm + k), Action(s, "B", k)]
        row += [Action(s, "B", m) for m in range(M - warm, M)]
        rows.append(tuple(row))
    return Schedule("1f1b", P, M, tuple(rows))


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation: every forward in order, no backward."""
    _check_sizes(num_stages, num_microbatches)
    rows = tuple(tuple(Action(s, "F", m) for m in range(num_microbatches)) for s in range(num_stages))
    return Schedule("forward", num_stages, num_microbatches, rows, training=False)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a training schedule by name (``"gpipe"`` or ``"1f1b"``)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule name: expected one of {sorted(SCHEDULES)}, found {name!r}")
    return SCHEDULES[name](num_stages, num_microbatches)


def in_flight(name: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Per stage, how many micro-batches' activations the named schedule holds at its peak.

    The closed form of :func:`max_in_flight` for the builders here — the one definition the
    partitioner's memory model uses: ``min(M, P - s)`` for 1F1B, ``M`` for GPipe.
    """
    _check_sizes(num_stages, num_microbatches)
    if name == "1f1b":
        return tuple(min(num_microbatches, num_stages - s) for s in range(num_stages))
    if name == "gpipe":
        return (num_microbatches,) * num_stages
    raise ScheduleError(f"schedule name: expected one of {sorted(SCHEDULES)}, found {name!r}")


def max_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose F has run and whose B has not (activations held).

    A forward-only schedule keeps nothing for a backward, so it holds 0.
    """
    if not schedule.training:
        return (0,) * schedule.num_stages
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


# -------------------------------------------------------------------------------- validation


def format_grid(schedule: Schedule, mark: Action | Iterable[Action] | None = None) -> str:
    """The rank-by-step grid of ``schedule``, with the actions in ``mark`` shown as ``[1F0]``."""
    marked = {mark} if isinstance(mark, Action) else set(mark or ())
    rows = schedule.actions
    width = max((len(str(a)) for row in rows for a in row), default=1) + 2
    label = len(f"stage {schedule.num_stages - 1}")
    steps = max((len(row) for row in rows), default=0)

    def cell(a: Action) -> str:
        return (f"[{a}]" if a in marked else f" {a} ").ljust(width)

    lines = ["step".ljust(label) + " | " + " ".join(f" {k}".ljust(width) for k in range(steps))]
    for s, row in enumerate(rows):
        lines.append(f"stage {s}".ljust(label) + " | " + " ".join(cell(a) for a in row))
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, what: str, mark: Action | Iterable[Action] | None = None) -> ScheduleError:
    return ScheduleError(
        f"schedule {schedule.name!r} (P={schedule.num_stages}, M={schedule.num_microbatches}): {what}\n"
        f"{format_grid(schedule, mark)}"
    )


def _check_actions(schedule: Schedule) -> None:
    """Every action on its own stage, in range, exactly once; F before B on each stage."""
    M = schedule.num_microbatches
    for s, row in enumerate(schedule.actions):
        seen: set[Action] = set()
        for a in row:
            if a.stage != s:
                raise _fail(schedule, f"{a} is listed on stage {s} but belongs to stage {a.stage}", a)
            if a.microbatch >= M:
                raise _fail(schedule, f"{a}: micro-batch {a.microbatch} is out of range 0..{M - 1}", a)
            if a.kind == "B" and not schedule.training:
                raise _fail(schedule, f"{a}: a forward-only schedule must not run a backward", a)
            if a in seen:
                raise _fail(schedule, f"{a} appears more than once on stage {s}; expected exactly once", a)
            if a.kind == "B" and Action(s, "F", a.microbatch) not in seen:
                raise _fail(schedule, f"{a} runs before {Action(s, 'F', a.microbatch)} on stage {s}; "
                                      "a backward needs its forward's activations", a)
            seen.add(a)
        kinds = KINDS if schedule.training else ("F",)
        missing = [str(Action(s, k, m)) for k in kinds for m in range(M) if Action(s, k, m) not in seen]
        if missing:
            raise _fail(schedule, f"stage {s} never runs {', '.join(missing)}; expected every micro-batch "
                                  f"0..{M - 1} {'forward and backward' if schedule.training else 'forward'}")


def _order(row: tuple[Action, ...], kind: str) -> list[Action]:
    return [a for a in row if a.kind == kind]


def _check_channels(schedule: Schedule) -> None:
    """Each receiver consumes a channel's messages in the order its sender sends them."""
    rows = schedule.actions
    for s in range(schedule.num_stages - 1):
        channels = [("activation", s, s + 1, "F")]
        if schedule.training:
            channels.append(("gradient", s + 1, s, "B"))
        for what, src, dst, kind in channels:
            sent, received = _order(rows[src], kind), _order(rows[dst], kind)
            for a, b in zip(sent, received):
                if a.microbatch != b.microbatch:
                    raise _fail(schedule, (
                        f"{b} on stage {dst} would receive the {what} of micro-batch {a.microbatch}: "
                        f"stage {src} sends {what}s in order {[x.microbatch for x in sent]} but stage {dst} "
                        f"receives them in order {[x.microbatch for x in received]}; point-to-point "
                        "messages arrive in send order, so both orders must match"), b)


def _check_backward_order(schedule: Schedule) -> None:
    if not schedule.training:
        return
    for s, row in enumerate(schedule.actions):
        bs = _order(row, "B")
        for prev, a in zip(bs, bs[1:]):
            if a.microbatch < prev.microbatch:
                raise _fail(schedule, (
                    f"{a} runs after {prev}: backwards must run in ascending micro-batch order on every "
                    "stage (the gradient accumulation order, which fixes the floating-point sum)"), a)


def _waits_for(a: Action, num_stages: int) -> Action | None:
    """The action on another stage whose message ``a`` receives, or None."""
    if a.kind == "F" and a.stage > 0:
        return Action(a.stage - 1, "F", a.microbatch)
    if a.kind == "B" and a.stage < num_stages - 1:
        return Action(a.stage + 1, "B", a.microbatch)
    return None


def _check_deadlock(schedule: Schedule) -> None:
    """Run every stage in order; receives block until sent, sends never block."""
    rows, P = schedule.actions, schedule.num_stages
    done: set[Action] = set()
    pos = [0] * P
    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pos[s] < len(rows[s]):
                a = rows[s][pos[s]]
                dep = _waits_for(a, P)
                if dep is not None and dep not in done:
                    break
                done.add(a)
                pos[s] += 1
                progress = True
    blocked = [rows[s][pos[s]] for s in range(P) if pos[s] < len(rows[s])]
    if blocked:
        waits = "; ".join(f"{a} waits for {_waits_for(a, P)}" for a in blocked)
        raise _fail(schedule, f"deadlock: no stage can make progress ({waits})", blocked)


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, message-ordered and deadlock-free; return it.

    Raises :class:`ScheduleError` with the grid and the offending action marked.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"validate: expected a Schedule, found {type(schedule).__name__}")
    _check_actions(schedule)
    _check_channels(schedule)
    _check_backward_order(schedule)
    _check_deadlock(schedule)
    return schedule
