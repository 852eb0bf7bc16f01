"""The agreement check: every rank planned the same subnets, partitions and schedule.

Ranks never ask each other what to do, so a rank whose arch stream or cost table differs would
silently compute something else. A plan carries a digest of its arch and bounds, a training
segment one of its schedule and plans; one all-reduce (MAX of ``digest`` and ``-digest``) on a
process group of its own shows whether all ranks hold the same. For a segment prepared ahead
the all-reduce is posted when the segment before ends and read when this one starts, before
anything of it runs or moves: no round trip on the critical path. A digest not made ahead is
checked when it is made (one round trip). When every rank runs on one host on the CPU the
digests go on a page of shared memory instead (:class:`pipeline.shm.DigestBoard`: two stores a
post, no gloo message), with the same outcome on every rank.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .lookahead import Plan
from .shm import DigestBoard
from .transport import peer_errors, wait_for

__all__ = ["Agreement", "AgreementError", "plan_what"]


_WHAT = "the agreement check with the other ranks"  # a lost rank: "... failed: <the backend's words>"


class AgreementError(RuntimeError):
    """The ranks planned different subnets or partitions."""


class Agreement:
    """Digests (63-bit ints) every rank must hold alike: a plan's, or a segment's schedule and plans."""

    def __init__(self, device: torch.device, timeout_s: float, enabled: bool, group: dist.ProcessGroup | None,
                 board: DigestBoard | None = None) -> None:
        # ``group``: None in a one-process job (nothing to agree on); ``board``: the digests in
        # shared memory instead of an all-reduce on ``group`` (every rank on this host)
        self.device, self.enabled, self.group = device, enabled and group is not None, group
        self.board = board if self.enabled else None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # (the all-reduce's work and tensor, or None and the board's round; the digest; what it is)
        self._posted: tuple[dist.Work | None, torch.Tensor | int, int, str] | None = None
        self.round_trips = 0  # checks made on the critical path (:meth:`check`): a digest not posted ahead

    def post(self, digest: int, what: str) -> None:
        """Start checking a digest made ahead (``what`` names it in the error)."""
        if not self.enabled:
            return
        if self.board is not None:
            self._posted = (None, self.board.post(digest), digest, what)
            return
        t = self._tensor(digest)
        with peer_errors(_WHAT):
            self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t, digest,
                            what)

    def read(self, strict: bool = True) -> int | None:
        """Finish the check posted earlier; the digest it checked. When the ranks disagreed:
        raise, or with ``strict`` false return None (every rank sees the same all-reduced
        result, so every rank then checks what it really runs, alike)."""
        if self._posted is None:
            return None
        (work, t, digest, what), self._posted = self._posted, None
        if self.board is not None:
            agreed = all(d == digest for d in self.board.read(t))  # (t: the board's round)
        else:
            wait_for(work, self.timeout, _WHAT)
            agreed = _agreed(t, digest)
        if not agreed and strict:
            _disagree(what)
        return digest if agreed else None

    def check(self, digest: int, what: str, checked: int | None = None) -> None:
        """Check ``digest`` now unless ``checked`` (what :meth:`read` returned) covered it."""
        if not self.enabled or checked == digest:
            return
        self.round_trips += 1
        if self.board is not None:
            if not all(d == digest for d in self.board.read(self.board.post(digest))):
                _disagree(what)
            return
        t = self._tensor(digest)
        with peer_errors(_WHAT):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        _compare(t, digest, what)

    def _tensor(self, digest: int) -> torch.Tensor:
        return torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)


def plan_what(plan: Plan) -> str:
    return f"the subnet or its partition (this rank: arch {plan.arch.digest()}, bounds {list(plan.partition.bounds)})"


def _agreed(t: torch.Tensor, digest: int) -> bool:
    hi, neg_lo = t.tolist()
    return hi == digest and -neg_lo == digest


def _compare(t: torch.Tensor, digest: int, what: str) -> None:
    if not _agreed(t, digest):
        _disagree(what)


def _disagree(what: str) -> None:
    raise AgreementError(
        f"ranks disagree on {what}; every rank must sample the same arch stream and use the same cost profile "
        "and settings"
    )
