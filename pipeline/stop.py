"""The stop vote: every rank stops at the same step when any of them was asked to (a signal).

Under torchrun a Ctrl-C reaches each rank on its own, at a different point of its step; a rank
that stopped alone would leave its peers waiting in the next step. So each rank posts whether it
was asked to stop, one MAX all-reduce on a gloo group of its own, before a unit of work (a
training step, an evaluation), and reads the result after it: every rank gets the same answer
at the same point. The all-reduce runs while the work computes (no round trip on the critical
path), so a request that comes during a unit is acted on after the next one. In one process
there is nobody to ask: the answer is the request itself, at once.

Create it at the same point on every rank (``new_group`` is collective).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .failures import StageFailure

__all__ = ["StopVote"]


class StopVote:
    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._posted: tuple[dist.Work, torch.Tensor] | None = None

    def post(self, asked: bool) -> None:
        """Start the vote on this rank's request (before the unit of work)."""
        if self.group is not None:
            t = torch.tensor([int(asked)], dtype=torch.int32)
            self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t)

    def result(self, asked: bool, step: int, where: str) -> bool:
        """Whether to stop now (after the unit of work): any rank's posted request, the same on
        every rank; in one process, ``asked``. ``where`` names the unit in errors (``step 12``),
        ``step`` is the training step (-1 after training)."""
        if self.group is None:
            return asked
        if self._posted is None:
            raise RuntimeError("StopVote.result without a posted vote")
        (work, t), self._posted = self._posted, None
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo raises when a peer is gone
            raise StageFailure(f"rank {self.rank} failed in the stop vote after {where}: {type(e).__name__}: {e}",
                               self.rank, step, "stop-vote") from e
        if ok is False:
            raise StageFailure(f"rank {self.rank} failed in the stop vote after {where}: no answer within "
                               f"{self.timeout.total_seconds():g} s", self.rank, step, "stop-vote")
        return bool(t.item())
