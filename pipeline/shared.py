"""Shared ops (in every subnet: stem, head, embeddings, norms): exact, delayed or frozen.

An op that every subnet runs conflicts with every subnet, so keeping several subnets in flight
needs a choice for it, made once per run (``pipeline.shared_ops``) and run the same way by the
single-process reference and the pipeline, so both compute the same bits:

* ``exact``: read after the previous subnet's update, as sequential training does.
* ``delayed`` (``pipeline.shared_delay`` = D): subnet ``t`` runs a private copy of the op's
  parameters and buffers as they were after the update of subnet ``r - 1``, where
  ``r = max(t - D, floor)`` and ``floor`` is the step of the last checkpoint boundary (so a run
  resumed from a checkpoint reads what the uninterrupted one read). Its gradients are applied
  to the current weights by the optimizer, in subnet order (one update per subnet, as in
  PipeDream-2BW's fixed delay); the buffers it updated (batch-norm statistics) replace the
  op's at that update. A ring of the last D + 1 versions is kept.
* ``frozen`` (NASPipe's choice): never updated. Each subnet runs a private copy whose
  parameters get no gradient and whose buffer updates are dropped, so no two subnets in flight
  touch the op's state and the order they run in cannot matter.

Pure bookkeeping over modules handed in; no messages. One instance per process, holding the
versions of the shared ops this process owns.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from supernet import SupernetGraph, build_op

from .settings import SHARED_MODES

__all__ = ["SharedOps", "SHARED_MODES", "shared_ops_of", "stateful_ops"]

VERSION = "version/"  # the prefix of a delayed op's kept versions in its moving state


@lru_cache(maxsize=64)
def stateful_ops(graph: SupernetGraph) -> frozenset[str]:
    """The ops with parameters or buffers (decided on the meta device, without real weights):
    the only ones whose order between subnets matters. Once per graph (the lookahead planner
    and the shared ops both ask) and one build per distinct spec (NASPipe's space: ~25 for
    ~1150 ops)."""
    has_state: dict = {}  # spec -> whether its module has parameters or buffers
    with torch.device("meta"):
        for slot in graph.slots():
            if slot.spec not in has_state:
                m = build_op(slot.spec, slot.op_id, 0, seeded=False)
                has_state[slot.spec] = any(True for _ in m.parameters()) or any(True for _ in m.buffers())
    return frozenset(slot.op_id for slot in graph.slots() if has_state[slot.spec])


def shared_ops_of(graph: SupernetGraph) -> frozenset[str]:
    """The ops every subnet runs that have state: the graph's fixed ops with parameters or buffers."""
    return frozenset(s.op_id for s in graph.slots() if s.op_id == s.node) & stateful_ops(graph)


class SharedOps:
    """Which module a subnet runs for each shared op, and what its update does (module doc)."""

    def __init__(self, mode: str, delay: int, shared: Iterable[str], checkpoint_every: int,
                 module: Callable[[str], nn.Module]) -> None:
        if mode not in SHARED_MODES:
            raise ValueError(f"pipeline.shared_ops: expected one of {list(SHARED_MODES)}, found {mode!r}")
        self.mode, self.delay, self.every = mode, delay, checkpoint_every
        self.shared = frozenset(shared)
        self._live = module
        self._versions: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # op -> step -> state after it
        self._private: dict[tuple[str, int], nn.Module] = {}  # (op, step) -> the module that subnet runs

    @property
    def delayed(self) -> frozenset[str]:
        return self.shared if self.mode == "delayed" else frozenset()

    @property
    def frozen(self) -> frozenset[str]:
        return self.shared if self.mode == "frozen" else frozenset()

    def floor(self, step: int) -> int:
        return (step // self.every) * self.every if self.every else 0

    def reads(self, step: int) -> int:
        """The step whose update produced the version of a delayed op that ``step`` reads
        (``floor - 1``: the state at the checkpoint boundary)."""
        return max(step - self.delay, self.floor(step)) - 1

    def begin(self, op: str, step: int) -> None:
        """Subnet ``step`` is about to run ``op`` (owned here): for a delayed op, make its
        private copy of the version it reads; for a frozen one, of its only version."""
        if op in self.frozen:
            private = copy.deepcopy(self._live(op))
            for p in private.parameters():
                p.requires_grad_(False)
                p.grad = None
            self._private[(op, step)] = private
            return
        if op not in self.delayed:
            return
        live = self._live(op)
        versions = self._versions.setdefault(op, {})
        k = self.reads(step)
        if k not in versions:
            if k != self.floor(step) - 1:
                raise RuntimeError(f"shared op {op!r}: subnet of step {step} reads the version after step {k}, "
                                   f"which was not kept (kept: {sorted(versions)})")
            versions[k] = _snapshot(live)  # the state at the checkpoint boundary (start or resume)
        private = copy.deepcopy(live)
        private.load_state_dict(versions[k])
        for p in private.parameters():
            p.grad = None
        self._private[(op, step)] = private

    def module(self, op: str, step: int) -> nn.Module:
        """The module subnet ``step`` runs for ``op``."""
        private = self._private.get((op, step))
        return private if private is not None else self._live(op)

    @contextmanager
    def updating(self, ops: Sequence[str], step: int) -> Iterator[list[str]]:
        """Around the optimizer step of ``ops`` (subnet ``step``'s, on this process): yields the
        ops to step (never a frozen one). Before it, a delayed op's gradients and buffers go from
        its private copy to the live op; after it, a delayed op's new version is kept for the
        subnets that read it later."""
        for op in ops:
            self._take_private(op, step)
        yield [op for op in ops if op not in self.frozen]
        for op in ops:
            self._keep_version(op, step)

    def _take_private(self, op: str, step: int) -> None:
        private = self._private.pop((op, step), None)
        if private is None or op in self.frozen:
            return
        live = self._live(op)
        for p, q in zip(live.parameters(), private.parameters()):
            p.grad = q.grad
        with torch.no_grad():
            for b, c in zip(live.buffers(), private.buffers()):
                b.copy_(c)

    def _keep_version(self, op: str, step: int) -> None:
        if op not in self.delayed:
            return
        versions = self._versions.setdefault(op, {})
        versions[step] = _snapshot(self._live(op))
        for k in [k for k in versions if k < step - self.delay - 1]:
            del versions[k]

    def export_versions(self, op: str) -> dict[str, torch.Tensor]:
        """The kept versions of a delayed op leaving this process (they travel with its state,
        as ``version/<step>/<name>`` entries): a mid-graph shared op may change stage."""
        return {f"{VERSION}{k}/{name}": t for k, state in self._versions.get(op, {}).items() for name, t in state.items()}

    def adopt_versions(self, op: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the versions out of an arriving op's state (kept here); returns the rest."""
        rest = {}
        for key, t in state.items():
            if key.startswith(VERSION):
                k, name = key[len(VERSION):].split("/", 1)
                self._versions.setdefault(op, {}).setdefault(int(k), {})[name] = t
            else:
                rest[key] = t
        return rest

    def drop(self, op: str) -> None:
        """``op`` left this process."""
        self._versions.pop(op, None)
        for key in [k for k in self._private if k[0] == op]:
            del self._private[key]


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
