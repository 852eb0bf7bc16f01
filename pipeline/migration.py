"""Migration: ops whose stage changes move with their optimizer state, now or ahead (and gathers).

*Now* (on the critical path): before a step runs, every op the new plan places on another
stage moves point to point. *Ahead*: ops the next subnet needs elsewhere and the current step
does not use (their state cannot change before the next step) move during the current step,
in a background thread on a process group of their own, and settle at the next step's start.
Every rank walks the same moves in the same order and updates the same owner table: every op
has exactly one owner at every moment.
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .plan.placement import Move, moves
from .memory import TensorManager
from .transport import Transport

__all__ = ["Migrator", "MigrationStats"]


@dataclass
class MigrationStats:
    ops: int = 0
    bytes: int = 0


class Migrator:
    def __init__(self, rank: int, owners: dict[str, int], tensors: TensorManager, transport: Transport,
                 early_transport: Transport | None) -> None:
        self.rank, self.owners, self.tensors = rank, owners, tensors
        self.transport, self.early_transport = transport, early_transport
        self._job: Future | None = None
        self._moves: list[Move] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipenas-migrate")

    def now(self, active: list, bounds: tuple[int, ...]) -> MigrationStats:
        """Move each op of ``active`` whose stage under ``bounds`` changed, point to point."""
        todo = moves(active, bounds, self.owners)
        sent = 0
        for mv in todo:
            if mv.src == self.rank:
                sent += self.transport.send_state(mv.op_id, self.tensors.export(mv.op_id), mv.dst)
            elif mv.dst == self.rank:
                self.tensors.adopt(mv.op_id, self.transport.recv_state(mv.op_id, mv.src))
            self.owners[mv.op_id] = mv.dst
        self.transport.flush()
        return MigrationStats(len(todo), sent)

    def start_ahead(self, active_next: list, bounds_next: tuple[int, ...], busy: Iterable[str]) -> int:
        """Start moving, in the background, the ops the next plan places elsewhere that this
        step does not use (``busy``: the ops this step runs). Returns how many move."""
        if self.early_transport is None:
            return 0
        busy = set(busy)
        early = [mv for mv in moves(active_next, bounds_next, self.owners) if mv.op_id not in busy]
        if not early:
            return 0
        outgoing = {mv.op_id: self.tensors.export(mv.op_id) for mv in early if mv.src == self.rank}
        transport, rank = self.early_transport, self.rank

        def run() -> dict[str, dict[str, torch.Tensor]]:
            received = {}
            for mv in early:
                if mv.src == rank:
                    transport.send_state(mv.op_id, outgoing[mv.op_id], mv.dst)
                elif mv.dst == rank:
                    received[mv.op_id] = transport.recv_state(mv.op_id, mv.src)
            transport.flush()
            return received

        self._moves = early
        self._job = self._pool.submit(run)
        return len(early)

    def settle(self) -> int:
        """Finish the background moves: adopt what arrived; every rank updates the owners."""
        if self._job is None:
            return 0
        job, self._job = self._job, None
        received = job.result()  # re-raises a failed transfer
        for mv in self._moves:
            if mv.dst == self.rank:
                self.tensors.adopt(mv.op_id, received[mv.op_id])
            self.owners[mv.op_id] = mv.dst
        n, self._moves = len(self._moves), []
        return n

    def gather(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Every op's flat state on rank 0, copied to the CPU (collective; the owners keep theirs)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for op_id in sorted(self.owners):
            owner = self.owners[op_id]
            if owner == self.rank:
                state = self.tensors.export(op_id, release=False)
                if self.rank == 0:
                    out[op_id] = {k: v.detach().cpu().clone() for k, v in state.items()}
                else:
                    self.transport.send_state(op_id, state, 0)
            elif self.rank == 0:
                out[op_id] = {k: t.cpu() for k, t in self.transport.recv_state(op_id, owner).items()}
        self.transport.flush()
        return out if self.rank == 0 else None

    def close(self, wait: bool) -> None:
        if wait:
            self.settle()
        self._pool.shutdown(wait=wait, cancel_futures=True)
