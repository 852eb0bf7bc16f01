"""The stop vote: every rank stops at the same step when any of them was asked to (a signal).

Under torchrun a Ctrl-C reaches each rank on its own, at a different point of its step; a rank
that stopped alone would leave its peers waiting in the next step. So the ranks vote: a MAX
all-reduce of each rank's request, on a gloo group of its own, posted before a unit of work (a
training step, an arch scored) and read after it, so it runs while the unit computes and every
rank gets the same answer at the same point. A request that comes during a unit waits for the
next vote. A vote costs ~0.5 ms of CPU per rank on gloo whatever it carries (measured on the
2-core machine), so the ranks do not vote on every unit: each vote also carries rank 0's choice
of how many units until the next one, about ``every_s`` seconds of them at rank 0's pace. In one
process there is nobody to ask: the answer is the request itself, at once.

Create it at the same point on every rank (``new_group`` is collective).
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from .failures import StageFailure

__all__ = ["StopVote"]


MAX_INTERVAL = 64  # units between votes at most, however fast they are


class StopVote:
    def __init__(self, rank: int, world_size: int, timeout_s: float, every_s: float = 0.2) -> None:
        self.rank, self.every_s = rank, every_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._unit = 0  # units of work so far (the same count on every rank)
        self._next = 0  # the unit that holds the next vote (the same on every rank: it was voted)
        self._last = (0, time.perf_counter())  # rank 0: the unit and the time of the last vote
        self._posted: tuple[dist.Work, torch.Tensor] | None = None

    def post(self, asked: bool) -> None:
        """Before a unit of work: start the vote on this rank's request, if the unit holds one."""
        if self.group is None or self._unit != self._next:
            return
        t = torch.tensor([int(asked), self._interval() if self.rank == 0 else 0], dtype=torch.int64)
        self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t)

    def result(self, asked: bool, step: int, where: str) -> bool:
        """Whether to stop now (after the unit of work): any rank's request at the last vote, the
        same on every rank; in one process, ``asked``. ``where`` names the unit in errors
        (``step 12``), ``step`` is the training step (-1 after training)."""
        if self.group is None:
            return asked
        unit, self._unit = self._unit, self._unit + 1
        if self._posted is None:
            return False
        (work, t), self._posted = self._posted, None
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo raises when a peer is gone
            raise StageFailure(f"rank {self.rank} failed in the stop vote after {where}: {type(e).__name__}: {e}",
                               self.rank, step, "stop-vote") from e
        if ok is False:
            raise StageFailure(f"rank {self.rank} failed in the stop vote after {where}: no answer within "
                               f"{self.timeout.total_seconds():g} s", self.rank, step, "stop-vote")
        stop, interval = (int(v) for v in t.tolist())
        self._next = unit + max(1, interval)
        return bool(stop)

    def _interval(self) -> int:
        """Rank 0: units until the vote after this one, about ``every_s`` at the pace since the last."""
        now = time.perf_counter()
        (unit, then), self._last = self._last, (self._unit, now)
        if self._unit == unit:
            return 1
        per_unit = (now - then) / (self._unit - unit)
        return max(1, min(MAX_INTERVAL, int(self.every_s / max(per_unit, 1e-9))))
