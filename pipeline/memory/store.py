"""Where a process's ops live: the :class:`Store` interface, and the all-resident store.

A tensor manager holds one store and drives every op through it the same way, whatever the
memory settings: :class:`ResidentStore` (no budget: every op on the device, the protocol's calls
cost nothing) or :class:`~pipeline.memory.virtual.VirtualStore` (a budget: host homes and a
bounded device arena). :func:`make_store` picks one from the settings.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from .settings import MemorySettings
from .state import OpState, flat_tensors, load_flat
from .stats import MemoryAudit, MemoryStats
from .virtual import VirtualStore

__all__ = ["Store", "ResidentStore", "make_store"]


class Store(Protocol):
    """The ops one process owns, wherever they live (see :class:`~pipeline.memory.TensorManager`
    for the order of the calls)."""

    virtual: bool  # whether ops live in host memory behind a bounded device arena
    module_device: torch.device  # where an op's module is built before ``add``

    def add(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer,
            state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take an op (its module on ``module_device``); a flat ``state`` overrides its tensors."""

    def remove(self, op_id: str) -> None:
        """Forget an op (after ``export``)."""

    def export(self, op_id: str, copy: bool = True) -> OpState:
        """The op's flat state."""

    def use(self, op_id: str, mutates: bool) -> None:
        """The op is about to be used: resident and pinned until ``release_step``."""

    def prefetch(self, upcoming: Sequence[Collection[str]],
                 host_budget: Sequence[float | None] | None = None) -> None:
        """The op sets of the coming steps, the step about to run first (``host_budget``: per
        step, the parameters the host may step for it; see :class:`~pipeline.memory.working_set.WorkingSet`)."""

    def ensure(self, op_ids: Collection[str]) -> None:
        """Make ``op_ids`` resident and pin them until ``release_step``."""

    def prepare_step(self, op_ids: Sequence[str]) -> list[str]:
        """Before the optimizer step of ``op_ids``; returns those that take a step."""

    def updating_home(self) -> frozenset[str]:
        """After ``prepare_step``: the ops whose update runs in their host home (the caller
        steps the others)."""

    def finish_step(self, stepped: Sequence[str], fresh: Sequence[str] = (),
                    host_step: Callable[[str, list], None] | None = None) -> None:
        """After the others' step: ``stepped`` took a step, ``fresh`` got its first optimizer
        state; ``host_step(op_id, grads)`` steps each op of ``updating_home`` with the gradients
        the store takes off its parameters (the store runs it, maybe on another thread)."""

    def release_step(self, advance: bool = True, ops: Collection[str] | None = None, done: int = 0,
                     in_flight: int = 0) -> MemoryStats:
        """End of a step (or of one subnet's use among several in flight): unpin (``ops``; None:
        every op), move the future on (drop its entry ``done``; the first ``in_flight`` entries are
        subnets still in flight), return the counters since the last release."""

    def stats(self) -> MemoryStats: ...

    def resident_bytes(self) -> int:
        """Bytes of op state on the device now."""

    def audit(self) -> MemoryAudit | None:
        """An independent count of the device tier (``None``: nothing to audit)."""

    def close(self) -> None: ...


class ResidentStore:
    """Every op resident on the device (no budget): the protocol's calls only count uses."""

    virtual = False

    def __init__(self, device: torch.device) -> None:
        self.device = self.module_device = device
        self.ops: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        self._bytes: dict[str, int] = {}  # each op's bytes, counted from its tensors once
        self._hits = 0

    def add(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer,
            state: Mapping[str, torch.Tensor] | None = None) -> None:
        if state is not None:
            load_flat(module, opt, state, self.device)
        self.ops[op_id] = (module, opt)

    def remove(self, op_id: str) -> None:
        del self.ops[op_id]
        self._bytes.pop(op_id, None)

    def export(self, op_id: str, copy: bool = True) -> OpState:
        """The op's tensors themselves, detached (the caller clones what it keeps)."""
        module, opt = self.ops[op_id]
        return {key: t.detach() for key, t in flat_tensors(module, list(module.parameters()), opt)}

    def use(self, op_id: str, mutates: bool) -> None: ...

    def prefetch(self, upcoming: Sequence[Collection[str]],
                 host_budget: Sequence[float | None] | None = None) -> None: ...

    def ensure(self, op_ids: Collection[str]) -> None:
        self._hits += sum(1 for o in dict.fromkeys(op_ids) if o in self.ops)

    def prepare_step(self, op_ids: Sequence[str]) -> list[str]:
        return list(op_ids)

    def updating_home(self) -> frozenset[str]:
        return frozenset()

    def finish_step(self, stepped: Sequence[str], fresh: Sequence[str] = (),
                    host_step: Callable[[str, list], None] | None = None) -> None:
        for op_id in fresh:
            self._bytes.pop(op_id, None)  # state created now: the op takes more bytes

    def release_step(self, advance: bool = True, ops: Collection[str] | None = None, done: int = 0,
                     in_flight: int = 0) -> MemoryStats:
        hits, self._hits = self._hits, 0
        nbytes = self.resident_bytes()
        return MemoryStats(None, nbytes, nbytes, hits=hits)

    def stats(self) -> MemoryStats:
        nbytes = self.resident_bytes()
        return MemoryStats(None, nbytes, nbytes)

    def resident_bytes(self) -> int:
        """Counted from the tensors themselves (each op once, again after its first step)."""
        return sum(self._bytes[o] if o in self._bytes else self._count(o) for o in self.ops)

    def _count(self, op_id: str) -> int:
        module, opt = self.ops[op_id]
        total = sum(t.nbytes for t in module.parameters()) + sum(t.nbytes for t in module.buffers())
        for st in opt.state.values():
            total += sum(t.nbytes for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        self._bytes[op_id] = total
        return total

    def audit(self) -> None:
        return None

    def close(self) -> None: ...


def make_store(settings: MemorySettings, device: torch.device, state_keys: Sequence[str]) -> Store:
    """The virtual store when a budget is set, else the resident one."""
    return VirtualStore(settings, device, state_keys) if settings.virtual else ResidentStore(device)
