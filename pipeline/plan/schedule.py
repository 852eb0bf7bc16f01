"""Pipeline schedules as data: which forward/backward action each stage runs, in which order.

A :class:`Schedule` holds one tuple of :class:`Action` per stage (rank ``s`` runs stage ``s``).
Communication is implied by the actions, never listed:

* ``F(s, m)`` for ``s > 0`` receives micro-batch ``m``'s activation from stage ``s - 1``, and
  for ``s < P - 1`` sends its output to stage ``s + 1`` when it ends;
* ``B(s, m)`` for ``s < P - 1`` receives the gradient of ``m`` from stage ``s + 1``, and for
  ``s > 0`` sends the input gradient to stage ``s - 1`` when it ends; it needs ``F(s, m)`` to
  have run on the same stage.
* ``W(s, m)`` (the B/W split of zero-bubble pipelines, Qi et al. 2024): when a schedule lists it,
  ``B(s, m)`` computes only the input gradient (and sends it as above) and ``W(s, m)`` the weight
  gradient, later on the same stage; it sends and receives nothing. Without a ``W``, ``B`` is the
  whole backward. Per (subnet, stage) either every micro-batch is split or none is.

Sends are asynchronous; a receive blocks until its message was sent. Each directed channel
(activations ``s -> s+1``, gradients ``s+1 -> s``) delivers messages in the order they were sent,
as NCCL point-to-point does, so the receiver must consume them in the sender's order.
Backwards (and weight gradients) run in ascending micro-batch order on every stage in every
schedule: that order is the gradient accumulation order, and fixing it fixes the floating-point
sum whatever the schedule.

1F1B (PipeDream-flush) for P=3, M=4; stage ``s`` warms up with ``min(M, P - s - 1)`` forwards,
then alternates one forward and one backward, then drains the remaining backwards::

    step    |  0     1     2     3     4     5     6     7
    stage 0 |  0F0   0F1   0F2   0B0   0F3   0B1   0B2   0B3
    stage 1 |  1F0   1F1   1B0   1F2   1B1   1F3   1B2   1B3
    stage 2 |  2F0   2B0   2F1   2B1   2F2   2B2   2F3   2B3

Columns are positions in each stage's list, not clock ticks; :mod:`pipeline.plan.simulate` gives
the timed view. ZB-H1 (:func:`zb_h1`) is 1F1B's order with every backward split, stage ``s``
running each weight gradient ``s`` backwards late (the last ``s`` fill its drain)::

    stage 0 |  0F0   0F1   0F2   0B0   0W0   0F3   0B1   0W1   0B2   0W2   0B3   0W3
    stage 1 |  1F0   1F1   1B0   1F2   1B1   1W0   1F3   1B2   1W1   1B3   1W2   1W3
    stage 2 |  2F0   2B0   2F1   2B1   2F2   2B2   2W0   2F3   2B3   2W1   2W2   2W3

Cross-subnet schedules (:mod:`pipeline.plan.admission`) keep several subnets in
flight: their actions name the subnet (``1F0@3``), each (subnet, stage) has an explicit update
``U``, and :class:`WaitRule` says what every action waits for. Everything here is pure: values
in, values out.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

__all__ = [
    "Action", "Schedule", "ScheduleError", "SCHEDULES", "Wait", "WaitRule", "Move",
    "gpipe", "one_f_one_b", "zb_h1", "forward_only", "build",
    "in_flight", "max_in_flight", "validate", "format_grid",
]

KINDS = ("F", "B", "W", "U")
_ACTION_RE = re.compile(r"^(\d+)(?:([FBW])(\d+)|(U))(?:@(\d+))?$")


class ScheduleError(ValueError):
    """A schedule is malformed, would mismatch messages, or would deadlock."""


@dataclass(frozen=True, order=True)
class Action:
    """Stage ``stage`` runs the forward (``"F"``), backward (``"B"``) or weight gradient (``"W"``,
    the second half of a split backward) of one micro-batch of subnet ``subnet``, or that
    subnet's optimizer update of the stage's ops (``"U"``, ``microbatch`` 0). Prints as ``1F0``
    (subnet 0), ``1B2@5`` (subnet 5), ``1W2@5`` or ``1U@5``."""

    stage: int
    kind: str
    microbatch: int
    subnet: int = 0

    def __post_init__(self) -> None:
        for name in ("stage", "microbatch", "subnet"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ScheduleError(f"Action.{name}: expected a non-negative int, found {v!r}")
        if self.kind not in KINDS:
            raise ScheduleError(f"Action.kind: expected one of {list(KINDS)}, found {self.kind!r}")
        if self.kind == "U" and self.microbatch != 0:
            raise ScheduleError(f"Action.microbatch: an update ('U') covers every micro-batch; expected 0, "
                                f"found {self.microbatch}")

    def __str__(self) -> str:
        body = f"{self.stage}U" if self.kind == "U" else f"{self.stage}{self.kind}{self.microbatch}"
        return f"{body}@{self.subnet}" if self.subnet else body

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"1F0"`` back into ``Action(1, "F", 0)``, ``"0U@3"`` into ``Action(0, "U", 0, 3)``."""
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"Action.parse: expected '<stage><F|B|W><microbatch>[@<subnet>]' such as '1F0', '0B3' or '2F1@4', "
                f"or '<stage>U[@<subnet>]', found {text!r}"
            )
        stage, kind, mb, upd, subnet = match.groups()
        return cls(int(stage), kind or upd, int(mb) if mb else 0, int(subnet) if subnet else 0)


@dataclass(frozen=True)
class Wait:
    """One thing an action waits for: ``action`` (None: the schedule's start) must have run.

    ``message``: what travels from ``action``'s stage to the waiting one — ``"activation"``,
    ``"gradient"``, ``"losses"`` (the last stage's micro-batch losses of a subnet, which every
    update needs), ``"norm"`` (a stage's gradient sums of squares of a subnet, which every other
    stage's update needs when it clips) or ``"state"`` (``op``'s weights and optimizer state moving stage); None: the
    two actions are on the same stage and only their order matters."""

    action: Action | None
    message: str | None = None
    op: str | None = None


@dataclass(frozen=True)
class Move:
    """Op ``op`` moves from stage ``src`` to ``dst``: sent when ``after`` has run (None: at the
    schedule's start), needed by ``before``."""

    op: str
    src: int
    dst: int
    after: Action | None
    before: Action


@dataclass(frozen=True)
class Schedule:
    """One ordered tuple of actions per stage; ``training=False`` for forward-only schedules.

    One-subnet schedules (GPipe, 1F1B) list F and B only; the update follows the last action.
    Cross-subnet schedules (:mod:`pipeline.plan.admission`) name the subnet of every action and
    list an explicit update ``U`` per (subnet, stage); ``uses[t][s]`` is the set of ops with state
    (parameters or buffers) that subnet ``t`` runs on stage ``s``, from which :class:`WaitRule`
    derives every wait. ``frozen`` ops are never updated (no order between subnets);
    ``delayed`` ops are read ``delay`` updates late (subnet ``t`` reads the state after the
    update of subnet ``t - delay - 1``, updates still in subnet order), or as many as ``delays``
    gives an op (``pipeline.shared_delays``: (op, delay >= 1) pairs); every other op is read
    after the update of the subnet before that uses it (exact). ``origin``: the stage of each
    op before the schedule starts (None: every op already sits where it is first used).
    ``norms`` (needs ``uses``): the updates clip the subnet's gradients to a global norm
    (``train.clip_grad_norm``), so each waits for every other stage's sums of squares of the
    subnet's gradients there, sent after that stage's last backward of the subnet.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    training: bool = True
    num_subnets: int = 1
    uses: tuple[tuple[frozenset[str], ...], ...] | None = None
    frozen: frozenset[str] = frozenset()
    delayed: frozenset[str] = frozenset()
    delay: int = 0
    origin: tuple[tuple[str, int], ...] | None = field(default=None)
    delays: tuple[tuple[str, int], ...] = ()
    norms: bool = False

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches", "num_subnets"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ScheduleError(f"Schedule.{name}: expected a positive int, found {v!r}")
        if not isinstance(self.delay, int) or isinstance(self.delay, bool) or self.delay < 0:
            raise ScheduleError(f"Schedule.delay: expected an int >= 0, found {self.delay!r}")
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
        if self.uses is not None:
            uses = tuple(tuple(frozenset(ops) for ops in row) for row in self.uses)
            object.__setattr__(self, "uses", uses)
            if len(uses) != self.num_subnets or any(len(row) != self.num_stages for row in uses):
                raise ScheduleError(
                    f"Schedule.uses: expected {self.num_subnets} subnets x {self.num_stages} stages of op sets, "
                    f"found {[len(row) for row in uses]}")
        object.__setattr__(self, "frozen", frozenset(self.frozen))
        object.__setattr__(self, "delayed", frozenset(self.delayed))
        if isinstance(self.origin, Mapping):
            object.__setattr__(self, "origin", tuple(sorted(self.origin.items())))
        delays = tuple(sorted(dict(self.delays).items()))
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for _, d in delays):
            raise ScheduleError(f"Schedule.delays: expected (op, int >= 1) pairs, found {delays!r}")
        object.__setattr__(self, "delays", delays)
        if self.norms and self.uses is None:
            raise ScheduleError("Schedule.norms: the gradient norm's messages need the ops each subnet runs "
                                "per stage (Schedule.uses), found none")

    def __str__(self) -> str:
        return format_grid(self)

    @cached_property
    def split(self) -> frozenset[tuple[int, int]]:
        """The (subnet, stage) pairs whose backward is split: each ``B`` there computes the input
        gradient only, and the listed ``W`` of its micro-batch the weight gradient."""
        return frozenset((a.subnet, a.stage) for row in self.actions for a in row if a.kind == "W")

    def input_only(self, a: Action) -> bool:
        """Whether ``a`` is a ``B`` whose weight gradient is a separate ``W`` (a split backward)."""
        return a.kind == "B" and (a.subnet, a.stage) in self.split

    def releases(self, a: Action) -> bool:
        """Whether ``a`` ends its micro-batch's hold of activations on its stage: the last part of
        its backward (the ``W`` of a split one, which needs ``B``'s record; else the ``B``)."""
        return a.kind == ("W" if (a.subnet, a.stage) in self.split else "B")

    @property
    def updates(self) -> bool:
        """Whether the schedule lists its updates (a cross-subnet schedule) or implies one at the end."""
        return any(a.kind == "U" for row in self.actions for a in row)

    @cached_property
    def rule(self) -> WaitRule:
        """The wait rule of this schedule (one per schedule; every user asks it)."""
        return WaitRule(self.num_stages, self.num_microbatches, self.num_subnets, self.uses, self.frozen,
                        self.delayed, self.delay, dict(self.origin) if self.origin is not None else None,
                        self.updates, self.training, self.split, dict(self.delays), self.norms)


class WaitRule:
    """The one definition of what an action waits for; the validator, the simulator, the
    admission builder and the stage executor all ask it.

    * ``F(t, m, s)`` waits for ``F(t, m, s - 1)`` (its input activation);
    * ``B(t, m, s)`` waits for ``F(t, m, s)`` (same stage) and ``B(t, m, s + 1)`` (its gradient);
    * ``W(t, m, s)`` (where ``(t, s)`` is in ``split``) waits for ``B(t, m, s)`` (same stage);
    * ``U(t, s)`` waits for every ``B(t, m, s)`` (every ``W(t, m, s)`` when split) and, off the
      last stage, ``U(t, P - 1)``, which sends the subnet's micro-batch losses (an update is
      skipped when one is not finite); with ``norms``, and ops to step on its stage, also the
      last backward (weight gradient when split) of ``t`` on every other stage with ops to step,
      which sends its sums of squares of the subnet's gradients there (clipping's global norm);
    * with ``uses``: ``F(t, 0, s)`` waits, for each op it runs, for the update that produces the
      version it reads — the last earlier subnet using the op (exact), the one ``delay + 1``
      users back (delayed), none (frozen) — on the stage that op had then (a ``state`` message
      when it moves); ``U(t, s)`` of a delayed op waits for the previous update of that op; a
      delayed or frozen op, read without waiting for the previous user's update, is read after
      the first forward of the user it last arrived on this stage with (it moves between stages
      with its versions, so a later subnet cannot overtake its arrival).

    Each wait names the message it receives, so a sender knows what to send after each action
    (:meth:`sends`) and a receiver in which order messages come (:meth:`channel`).
    """

    def __init__(self, num_stages: int, num_microbatches: int, num_subnets: int,
                 uses: tuple[tuple[frozenset[str], ...], ...] | None, frozen: frozenset[str],
                 delayed: frozenset[str], delay: int, origin: Mapping[str, int] | None, updates: bool,
                 training: bool = True, split: Iterable[tuple[int, int]] = (),
                 delays: Mapping[str, int] | None = None, norms: bool = False) -> None:
        self.P, self.M, self.T = num_stages, num_microbatches, num_subnets
        self.norms = norms
        self.delays = dict(delays or {})  # a delayed op's own delay, where not ``delay``
        self.split = frozenset(split)  # the (subnet, stage) pairs with a W per micro-batch
        self.uses, self.frozen, self.delayed, self.delay = uses, frozen, delayed, delay
        self.origin, self.updates, self.training = origin, updates, training
        # per op: the (subnet, stage) of each use, in subnet order
        self.users: dict[str, list[tuple[int, int]]] = {}
        for t, row in enumerate(uses or ()):
            for s, ops in enumerate(row):
                for op in sorted(ops):
                    self.users.setdefault(op, []).append((t, s))
        self._index = {op: {t: k for k, (t, _) in enumerate(us)} for op, us in self.users.items()}
        self._cache: dict[Action, tuple[Wait, ...]] = {}

    def producer(self, op: str, subnet: int) -> tuple[int, int] | None:
        """The (subnet, stage) whose update produces the version of ``op`` that ``subnet`` reads
        (None: the state the op had before the schedule)."""
        k = self._index[op][subnet]
        if op in self.frozen:
            return None
        back = self.delays.get(op, self.delay) + 1 if op in self.delayed else 1
        return self.users[op][k - back] if k - back >= 0 else None

    def stepped(self, subnet: int, stage: int) -> frozenset[str]:
        """The ops subnet ``subnet``'s update steps on ``stage`` (never a frozen one)."""
        return self.uses[subnet][stage] - self.frozen if self.uses is not None else frozenset()

    def _last_backward(self, t: int, s: int) -> Action:
        """The action after which subnet ``t``'s gradients on stage ``s`` are final (backwards
        run in micro-batch order: the last micro-batch's backward, its weight gradient when split)."""
        return Action(s, "W" if (t, s) in self.split else "B", self.M - 1, t)

    def waits(self, a: Action) -> tuple[Wait, ...]:
        got = self._cache.get(a)
        if got is None:
            got = self._cache[a] = tuple(self._waits(a))
        return got

    def _waits(self, a: Action):
        P, s, t, m = self.P, a.stage, a.subnet, a.microbatch
        if a.kind == "F":
            if s > 0:
                yield Wait(Action(s - 1, "F", m, t), "activation")
            if m == 0 and self.uses is not None:
                for op in sorted(self.uses[t][s]):
                    yield from self._state_waits(op, t, s)
        elif a.kind == "B":
            yield Wait(Action(s, "F", m, t))
            if s < P - 1:
                yield Wait(Action(s + 1, "B", m, t), "gradient")
        elif a.kind == "W":
            yield Wait(Action(s, "B", m, t))
        else:
            last = "W" if (t, s) in self.split else "B"
            for k in range(self.M):
                yield Wait(Action(s, last, k, t))
            if s < P - 1:
                yield Wait(Action(P - 1, "U", 0, t), "losses")
            if self.norms and self.stepped(t, s):
                for s2 in range(P):
                    if s2 != s and self.stepped(t, s2):
                        yield Wait(self._last_backward(t, s2), "norm")
            if self.uses is not None:
                for op in sorted(self.uses[t][s] & self.delayed):
                    k = self._index[op][t]
                    if k > 0:
                        t0, s0 = self.users[op][k - 1]
                        yield Wait(Action(s0, "U", 0, t0))

    def _state_waits(self, op: str, t: int, s: int):
        """What ``F(t, 0, s)`` waits for on account of ``op``: the producing update, and the op
        itself when it sits elsewhere (moved after its previous user's update)."""
        k = self._index[op][t]
        prev = self.users[op][k - 1] if k > 0 else None
        prod = self.producer(op, t)
        if prod is not None and prod[1] == s and (prev is None or prev[1] == s):
            yield Wait(Action(s, "U", 0, prod[0]))
        if prev is None:
            src = self.origin.get(op, s) if self.origin is not None else s
            if src != s:
                yield Wait(None, "state", op)
        elif prev[1] != s:
            yield Wait(Action(prev[1], "U", 0, prev[0]), "state", op)
        elif op in self.delayed or op in self.frozen:
            # read without waiting for the previous user's update, but the op itself must be
            # here: after the first forward of the user it arrived with, when it moved
            arrival = self._arrival(op, k, s)
            if arrival is not None:
                yield Wait(Action(s, "F", 0, arrival))

    def _arrival(self, op: str, k: int, s: int) -> int | None:
        """The subnet with which ``op`` last arrived on stage ``s`` before its ``k``-th user
        (the users since then all on ``s``), or None when it has not moved there."""
        us = self.users[op]
        for j in range(k - 1, -1, -1):
            if us[j][1] != s:
                return None
            before = us[j - 1][1] if j > 0 else (self.origin.get(op, s) if self.origin is not None else s)
            if before != s:
                return us[j][0]
        return None

    def moves(self) -> tuple[Move, ...]:
        """Every op move the schedule implies, in subnet order."""
        return self._moves

    @cached_property
    def _moves(self) -> tuple[Move, ...]:
        out = []
        for op, us in self.users.items():
            for k, (t, s) in enumerate(us):
                src = us[k - 1][1] if k > 0 else (self.origin.get(op, s) if self.origin is not None else s)
                if src != s:
                    after = Action(src, "U", 0, us[k - 1][0]) if k > 0 else None
                    out.append(Move(op, src, s, after, Action(s, "F", 0, t)))
        return tuple(sorted(out, key=lambda mv: (mv.before.subnet, mv.op)))

    def sends(self, a: Action | None, stage: int | None = None) -> tuple[tuple[int, Wait], ...]:
        """The messages the stage of ``a`` sends when ``a`` has run (None: what ``stage`` sends
        at the start, or every stage when ``stage`` is None), as (destination stage, wait), in
        sending order: activations or gradients, gradient norms or losses to every other stage,
        then op states by op name."""
        if a is None:
            return tuple((mv.dst, Wait(None, "state", mv.op)) for mv in self._moves_after.get(None, ())
                         if stage is None or mv.src == stage)
        out: list[tuple[int, Wait]] = []
        if a.kind == "F" and a.stage < self.P - 1:
            out.append((a.stage + 1, Wait(a, "activation")))
        elif a.kind == "B" and a.stage > 0 and self.training:
            out.append((a.stage - 1, Wait(a, "gradient")))
        if (self.norms and a.kind in "BW" and a == self._last_backward(a.subnet, a.stage)
                and self.stepped(a.subnet, a.stage)):
            out += [(s, Wait(a, "norm")) for s in range(self.P) if s != a.stage and self.stepped(a.subnet, s)]
        if a.kind == "U" and a.stage == self.P - 1:
            out += [(s, Wait(a, "losses")) for s in range(self.P - 1)]
        out += [(mv.dst, Wait(a, "state", mv.op)) for mv in self._moves_after.get(a, ())]
        return tuple(out)

    @cached_property
    def _moves_after(self) -> dict[Action | None, list[Move]]:
        by: dict[Action | None, list[Move]] = {}
        for mv in sorted(self.moves(), key=lambda mv: (mv.dst, mv.op)):
            by.setdefault(mv.after, []).append(mv)
        return by

    def channel(self, rows: Sequence[Sequence[Action]], src: int, dst: int) -> list[Wait]:
        """The messages stage ``src`` sends ``dst`` over the whole schedule, in sending order."""
        out = [w for d, w in self.sends(None, src) if d == dst]
        for a in rows[src]:
            out += [w for d, w in self.sends(a) if d == dst]
        return out


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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024; torch's ``ScheduleInterleavedZeroBubble`` with one stage per
    rank): 1F1B's forwards and backwards in 1F1B's order, every backward split; stage ``s`` runs
    the weight gradient of micro-batch ``k - s`` after backward ``k`` (the first ``s`` wait), and
    the deferred ones after its last backward, where the drain would idle. Input gradients reach
    stage 0 sooner (a split ``B`` is shorter), and the deferred ``W`` fill the drain.

    Activations are held from ``F`` to ``W``: ``min(M, P)`` micro-batches on every stage, 1F1B's
    peak (its stage 0's) on every stage (:func:`in_flight`).
    """
    base = one_f_one_b(num_stages, num_microbatches)
    rows = []
    for s, row in enumerate(base.actions):
        split: list[Action] = []
        for a in row:  # 1F1B's row, W(k - s) right after B(k)
            split.append(a)
            if a.kind == "B" and a.microbatch >= s:
                split.append(Action(s, "W", a.microbatch - s))
        split += [Action(s, "W", m) for m in range(max(num_microbatches - s, 0), num_microbatches)]
        rows.append(tuple(split))
    return Schedule("zbh1", num_stages, num_microbatches, tuple(rows))


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation: every forward in order, no backward."""
    _check_sizes(num_stages, num_microbatches)
    rows = tuple(tuple(Action(s, "F", m) for m in range(num_microbatches)) for s in range(num_stages))
    return Schedule("forward", num_stages, num_microbatches, rows, training=False)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zb_h1}


def build(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a training schedule by name (``"gpipe"``, ``"1f1b"`` or ``"zbh1"``)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule name: expected one of {sorted(SCHEDULES)}, found {name!r}")
    return SCHEDULES[name](num_stages, num_microbatches)


def in_flight(name: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Per stage, how many micro-batches' activations the named schedule holds at its peak.

    The closed form of :func:`max_in_flight` for the builders here (the partitioner's memory
    model counts the schedule object itself, ``PartitionProblem.in_flight``): ``min(M, P - s)``
    for 1F1B, ``M`` for GPipe, ``min(M, P)`` for ZB-H1 (held until the weight gradient).
    """
    _check_sizes(num_stages, num_microbatches)
    if name == "1f1b":
        return tuple(min(num_microbatches, num_stages - s) for s in range(num_stages))
    if name == "zbh1":
        return (min(num_microbatches, num_stages),) * num_stages
    if name == "gpipe":
        return (num_microbatches,) * num_stages
    raise ScheduleError(f"schedule name: expected one of {sorted(SCHEDULES)}, found {name!r}")


def max_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose F has run and whose backward has not ended
    (activations held): until its B, or its W when the backward is split (W needs B's record).

    A forward-only schedule keeps nothing for a backward, so it holds 0.
    """
    if not schedule.training:
        return (0,) * schedule.num_stages
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += 1 if a.kind == "F" else -schedule.releases(a)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


# -------------------------------------------------------------------------------- validation


def format_grid(schedule: Schedule, mark: Action | Iterable[Action] | None = None, around: int | None = None) -> str:
    """The rank-by-step grid of ``schedule``, with the actions in ``mark`` shown as ``[1F0]``;
    with ``around``, only the columns within that many of the first marked action's (a long
    cross-subnet schedule would print hundreds)."""
    marked = {mark} if isinstance(mark, Action) else set(mark or ())
    rows = schedule.actions
    width = max((len(str(a)) for row in rows for a in row), default=1) + 2
    label = len(f"stage {schedule.num_stages - 1}")
    steps = max((len(row) for row in rows), default=0)
    cols = range(steps)
    if around is not None:
        at = next((k for row in rows for k, a in enumerate(row) if a in marked), None)
        if at is not None:
            cols = range(max(0, at - around), min(steps, at + around + 1))

    def cell(row: tuple[Action, ...], k: int) -> str:
        if k >= len(row):
            return ""
        a = row[k]
        return (f"[{a}]" if a in marked else f" {a} ").ljust(width)

    lines = ["step".ljust(label) + " | " + " ".join(f" {k}".ljust(width) for k in cols)]
    for s, row in enumerate(rows):
        lines.append(f"stage {s}".ljust(label) + " | " + " ".join(cell(row, k) for k in cols))
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, what: str, mark: Action | Iterable[Action] | None = None) -> ScheduleError:
    return ScheduleError(
        f"schedule {schedule.name!r} (P={schedule.num_stages}, M={schedule.num_microbatches}): {what}\n"
        f"{format_grid(schedule, mark)}"
    )


def _check_actions(schedule: Schedule) -> None:
    """Every action on its own stage, in range, exactly once; F before B before W on each stage;
    a W for every micro-batch of a split (subnet, stage) or none; with updates, one U per subnet
    and stage after that subnet's backwards (weight gradients when split)."""
    M, T, upd, split = schedule.num_microbatches, schedule.num_subnets, schedule.updates, schedule.split
    for s, row in enumerate(schedule.actions):
        seen: set[Action] = set()
        for a in row:
            if a.stage != s:
                raise _fail(schedule, f"{a} is listed on stage {s} but belongs to stage {a.stage}", a)
            if a.microbatch >= M:
                raise _fail(schedule, f"{a}: micro-batch {a.microbatch} is out of range 0..{M - 1}", a)
            if a.subnet >= T:
                raise _fail(schedule, f"{a}: subnet {a.subnet} is out of range 0..{T - 1}", a)
            if a.kind != "F" and not schedule.training:
                raise _fail(schedule, f"{a}: a forward-only schedule must not run a backward or an update", a)
            if a in seen:
                raise _fail(schedule, f"{a} appears more than once on stage {s}; expected exactly once", a)
            if a.kind == "B" and Action(s, "F", a.microbatch, a.subnet) not in seen:
                raise _fail(schedule, f"{a} runs before {Action(s, 'F', a.microbatch, a.subnet)} on stage {s}; "
                                      "a backward needs its forward's activations", a)
            if a.kind == "W" and Action(s, "B", a.microbatch, a.subnet) not in seen:
                raise _fail(schedule, f"{a} runs before {Action(s, 'B', a.microbatch, a.subnet)} on stage {s}; "
                                      "a weight gradient needs its backward's record (expected W after its B)", a)
            if a.kind == "U":
                last, what = ("W", "weight gradient") if (a.subnet, s) in split else ("B", "backward")
                late = [str(Action(s, last, m, a.subnet)) for m in range(M)
                        if Action(s, last, m, a.subnet) not in seen]
                if late:
                    raise _fail(schedule, f"{a} runs before {', '.join(late)}; an update needs every {what} "
                                          "of its subnet on its stage", a)
            seen.add(a)
        for t in sorted(t for t, s2 in split if s2 == s):
            unsplit = [m for m in range(M) if Action(s, "W", m, t) not in seen]
            if unsplit:
                have = [m for m in range(M) if m not in unsplit]
                raise _fail(schedule, (
                    f"stage {s} splits the backward of subnet {t}'s micro-batches {have} (a W each) but not of "
                    f"{unsplit}: expected a W for every micro-batch of a (subnet, stage) or for none"),
                    [Action(s, "B", m, t) for m in unsplit])
        kinds = ("F", "B") if schedule.training else ("F",)
        missing = [str(Action(s, k, m, t)) for t in range(T) for k in kinds for m in range(M)
                   if Action(s, k, m, t) not in seen]
        if upd:
            missing += [str(Action(s, "U", 0, t)) for t in range(T) if Action(s, "U", 0, t) not in seen]
        if missing:
            raise _fail(schedule, f"stage {s} never runs {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
                                  f"expected every micro-batch 0..{M - 1} "
                                  f"{'forward and backward' if schedule.training else 'forward'}"
                                  f"{' and one update' if upd else ''} of every subnet")
    if T > 1 and not upd and schedule.training:
        raise ScheduleError(f"schedule {schedule.name!r}: {T} subnets but no update actions; a schedule of "
                            "several subnets lists each subnet's update per stage ('U')")


def _order(row: tuple[Action, ...], kind: str, subnet: int | None = None) -> list[Action]:
    return [a for a in row if a.kind == kind and (subnet is None or a.subnet == subnet)]


def _check_channels(schedule: Schedule) -> None:
    """Without updates (the one-subnet executor, which receives in action order): each receiver
    consumes a channel's messages in the order its sender sends them. A schedule with updates is
    run by an executor that receives each channel in sending order and keeps what comes early."""
    if schedule.updates:
        return
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


def _check_microbatch_order(schedule: Schedule) -> None:
    """Backwards, weight gradients (and, with updates, forwards) of each subnet run in ascending
    micro-batch order on every stage: the backward order (the weight gradients' when split) is
    the gradient accumulation order, which fixes the floating-point sum; the forward order is
    the order batch-norm statistics are updated in."""
    kinds = ("B", "W", "F") if schedule.updates else ("B", "W")
    if not schedule.training:
        return
    for s, row in enumerate(schedule.actions):
        for kind in kinds:
            for t in range(schedule.num_subnets):
                xs = _order(row, kind, t)
                for prev, a in zip(xs, xs[1:]):
                    if a.microbatch < prev.microbatch:
                        what = {"B": "backwards", "W": "weight gradients", "F": "forwards"}[kind]
                        raise _fail(schedule, (
                            f"{a} runs after {prev}: {what} must run in ascending micro-batch order on every "
                            "stage (the gradient accumulation order, which fixes the floating-point sum)"), a)


def _check_update_order(schedule: Schedule) -> None:
    """Ops read the version the rule says: a forward after the update it reads on its own stage
    (an op that moved waits for its state message, sent after its previous user's update, so the
    updates it depends on elsewhere are done by then; delayed and frozen ops move with their
    versions like any other)."""
    if schedule.uses is None:
        return
    rule = schedule.rule
    for s, row in enumerate(schedule.actions):
        pos = {a: i for i, a in enumerate(row)}
        for a in row:
            for w in rule.waits(a):
                if (w.message is None and w.action is not None and w.action.stage == s
                        and pos.get(w.action, len(row)) > pos[a]):
                    if w.action.kind == "U" and a.kind in "FU":
                        op = sorted(schedule.uses[a.subnet][s] & schedule.uses[w.action.subnet][s])
                        raise _fail(schedule, (
                            f"{a} runs before {w.action} on stage {s}, but subnet {a.subnet} must read the ops "
                            f"{op[:4]} as updated by subnet {w.action.subnet}: this breaks the op update order "
                            "(each op is updated in subnet order and read after the update it depends on)"),
                            (a, w.action))


def _check_deadlock(schedule: Schedule) -> None:
    """Run every stage in order; receives block until sent (and keep what comes early), sends
    never block."""
    rows, P, rule = schedule.actions, schedule.num_stages, schedule.rule
    done: set[Action] = set()
    pos = [0] * P
    progress = True

    def blocked_on(a: Action) -> list[Wait]:
        return [w for w in rule.waits(a) if w.action is not None and w.action not in done]

    while progress:
        progress = False
        for s in range(P):
            while pos[s] < len(rows[s]):
                a = rows[s][pos[s]]
                if blocked_on(a):
                    break
                done.add(a)
                pos[s] += 1
                progress = True
    blocked = [rows[s][pos[s]] for s in range(P) if pos[s] < len(rows[s])]
    if blocked:
        waits = "; ".join(f"{a} waits for {blocked_on(a)[0].action}" for a in blocked)
        raise _fail(schedule, f"deadlock: no stage can make progress ({waits})", blocked)


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, message-ordered and deadlock-free; return it.

    Raises :class:`ScheduleError` with the grid and the offending action marked.
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"validate: expected a Schedule, found {type(schedule).__name__}")
    _check_actions(schedule)
    _check_channels(schedule)
    _check_microbatch_order(schedule)
    _check_update_order(schedule)
    _check_deadlock(schedule)
    return schedule
