"""The value types the planning modules share: what a subnet costs (:class:`SubnetWork`), a
copy on a host or peer channel (:class:`Copy`, :class:`CopySpan`), the links' rates
(:class:`HostLinks`), and the error the simulator raises. Values only, so the clock, the
admission builder and the simulator all import them and none imports another for its types.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .schedule import Action, ScheduleError

__all__ = ["SubnetWork", "Copy", "CopySpan", "HostLinks", "SimulationError", "WEIGHT_SHARE", "weight_seconds"]

# The weight gradient's share of a backward when none is given: a matmul's backward is two
# matmuls of its forward's size, one for the input gradient and one for the weight gradient.
WEIGHT_SHARE = 0.5


def weight_seconds(bwd: Sequence[float], bwd_weight: Sequence[float] | None = None) -> tuple[float, ...]:
    """A split backward's W seconds per stage: ``bwd_weight``, or :data:`WEIGHT_SHARE` of ``bwd``
    when none is given."""
    return tuple(WEIGHT_SHARE * float(b) for b in bwd) if bwd_weight is None else tuple(float(x) for x in bwd_weight)


class SimulationError(ValueError):
    """The simulator was given costs that do not fit the schedule."""


@dataclass(frozen=True)
class SubnetWork:
    """One subnet of the sequence: per stage, the ops with state it runs there (``uses``) and
    the seconds of one micro-batch's forward and backward (``fwd``, ``bwd``); per cut, the
    seconds its activation or gradient takes on the link (``send``); per stage, the update's
    seconds (``update``, default 0) and the weight gradient's part of ``bwd`` (``bwd_weight``:
    a split backward's W takes it, its B the rest; default :data:`WEIGHT_SHARE`
    of ``bwd``)."""

    uses: tuple[frozenset[str], ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    send: tuple[float, ...] = ()
    update: tuple[float, ...] = ()
    bwd_weight: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        P = len(self.uses)
        object.__setattr__(self, "uses", tuple(frozenset(u) for u in self.uses))
        for name, n in (("fwd", P), ("bwd", P), ("send", P - 1), ("update", P), ("bwd_weight", P)):
            v = tuple(float(x) for x in getattr(self, name))
            if not v and name in ("send", "update"):
                v = (0.0,) * n
            elif not v and name == "bwd_weight":  # bwd is checked by now
                v = weight_seconds(self.bwd)
            if len(v) != n or not all(math.isfinite(x) and x >= 0 for x in v):
                raise ScheduleError(f"SubnetWork.{name}: expected {n} finite non-negative seconds, found {v!r}")
            object.__setattr__(self, name, v)
        late = [s for s in range(P) if self.bwd_weight[s] > self.bwd[s]]
        if late:
            raise ScheduleError(f"SubnetWork.bwd_weight: expected at most bwd per stage (the weight gradient is "
                                f"part of the backward), found {self.bwd_weight} against bwd {self.bwd}")


@dataclass(frozen=True)
class Copy:
    """One job on a stage's channel (``channel``: ``h2d``, ``d2h``, ``host``, ``peer_out`` or ``peer_in``).

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
    """Per stage: the host link's rate each way (bytes/s), the host's update rate (bytes of
    parameters per second; None: no host work) and the peer link's rate each way (None: no peer
    link). ``*_free_at``: when each channel is next free on the step's clock (default: free)."""

    h2d: tuple[float, ...]
    d2h: tuple[float, ...]
    host: tuple[float, ...] | None = None
    h2d_free_at: tuple[float, ...] | None = None
    d2h_free_at: tuple[float, ...] | None = None
    host_free_at: tuple[float, ...] | None = None
    peer_out: tuple[float, ...] | None = None
    peer_in: tuple[float, ...] | None = None
    peer_out_free_at: tuple[float, ...] | None = None
    peer_in_free_at: tuple[float, ...] | None = None

    def rate(self, channel: str, stage: int) -> float:
        rates = getattr(self, channel)
        if rates is None:
            what = "a host update rate" if channel == "host" else "a peer link rate"
            raise SimulationError(f"copy on channel {channel!r} of stage {stage}: HostLinks.{channel} is None; "
                                  f"expected {what} per stage")
        return rates[stage]
