"""The agreement check: every rank planned the same subnet and the same partition.

Ranks never ask each other what to do, so a rank whose arch stream or cost table differs would
silently compute something else. Each plan carries a digest of its arch and bounds; one
all-reduce (MAX of ``digest`` and ``-digest``) on a process group of its own shows whether all
ranks hold the same. For a plan made ahead the all-reduce is posted while the step before runs
and read at the start of the step that uses it, before anything of that step moves: no round
trip on the critical path. A plan not made ahead is checked when it is made (one round trip).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .lookahead import Plan
from .transport import peer_errors, wait_for

__all__ = ["Agreement", "AgreementError"]


_WHAT = "the agreement check with the other ranks"  # a lost rank: "... failed: <the backend's words>"


class AgreementError(RuntimeError):
    """The ranks planned different subnets or partitions."""


class Agreement:
    def __init__(self, device: torch.device, timeout_s: float, enabled: bool, group: dist.ProcessGroup | None) -> None:
        # ``group``: None in a one-process job (nothing to agree on)
        self.device, self.enabled, self.group = device, enabled and group is not None, group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._posted: tuple[dist.Work, torch.Tensor, Plan] | None = None

    def post(self, plan: Plan) -> None:
        """Start checking a plan made ahead."""
        if self.enabled:
            t = self._tensor(plan)
            with peer_errors(_WHAT):
                self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t, plan)

    def read(self) -> Plan | None:
        """Finish the check posted a step ago (raises if the ranks disagreed); the plan it checked."""
        if self._posted is None:
            return None
        (work, t, plan), self._posted = self._posted, None
        wait_for(work, self.timeout, _WHAT)
        _compare(t, plan)
        return plan

    def check(self, plan: Plan, checked: Plan | None) -> None:
        """Check ``plan`` now unless ``checked`` (what :meth:`read` returned) covered it."""
        if not self.enabled or (checked is not None and checked.digest == plan.digest):
            return
        t = self._tensor(plan)
        with peer_errors(_WHAT):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        _compare(t, plan)

    def _tensor(self, plan: Plan) -> torch.Tensor:
        return torch.tensor([plan.digest, -plan.digest], dtype=torch.int64, device=self.device)


def _compare(t: torch.Tensor, plan: Plan) -> None:
    hi, neg_lo = t.tolist()
    if hi != plan.digest or -neg_lo != plan.digest:
        raise AgreementError(
            f"ranks disagree on the subnet or its partition (this rank: arch {plan.arch.digest()}, "
            f"bounds {list(plan.partition.bounds)}); every rank must sample the same arch stream "
            "and use the same cost profile"
        )
