"""The virtualized tensor manager's model: an op's placement and layout, the counters, the errors.

Every op owned by a process has a home in host memory (:func:`memory_arena.host_buffer`:
pinned on CUDA) holding its weights, buffers and optimizer state in one :class:`OpLayout`. An
op is *resident* when the same bytes sit in a region of the device :class:`Arena` and the
module's parameters, buffers and optimizer state are views of that region; otherwise they are
views of the host home (an op in host memory can be exported, or migrated, without touching
the device). The arena has the budget's size, so the device tier can never hold more.

The engine says what it will need: :meth:`~pipeline.memory_store.VirtualStore.prefetch` takes the op sets of the
coming steps (the first is the step about to run); :meth:`ensure` pins a step's ops and waits
for them (a *hit* when resident before, *late* when its prefetch was still in flight, a *miss*
when fetched on demand; the wait is stall time); :meth:`release_step` unpins them and moves the
future on. Fetches for the coming steps run in the background (one worker thread on CPU, a side
stream on CUDA), at most ``max_in_flight`` copies at once. Eviction (policy ``belady``) takes
the op whose next use is furthest away, never one needed no later than the op being fetched;
``lru`` takes the least recently used op, ``on_demand`` does not prefetch at all (the same
rules as :func:`pipeline.plan.residency.plan_residency`, online). An evicted op is copied back
only when dirty: it took an optimizer step, or it has buffers (batch norm) and was used.

Physics of the placement (``memory.optimizer``). ``device`` (the default): the optimizer state
travels with the op and is updated on the device, so a fetch or write-back of an fp32 op moves
4 bytes per parameter of weights plus 4 (SGD momentum) or 8 (AdamW moments) of state: 12 or 16
bytes each way, but an op that stays resident across steps moves nothing. ``host``: the state
stays in the host home and the host runs the update (:meth:`~pipeline.memory_store.VirtualStore.to_host`): 4 bytes of
weights per parameter go to the device and 4 of gradients come back, every step the op is used
(the device copy is stale after the update), and the host's update time is on the critical
path of a synchronous step. Gradients are not in the arena: autograd allocates them during the
backward and the step frees them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

from .memory_arena import Handle, OpLayout

__all__ = ["MemoryStats", "MemoryAudit", "MemoryBudgetError", "OpPlacement", "optim_state_keys", "op_layout", "device_bytes",
           "HOST", "FETCHING", "RESIDENT"]

HOST, FETCHING, RESIDENT = "host", "fetching", "resident"


class MemoryBudgetError(ValueError):
    """The device budget cannot hold what must be resident at once."""

    def __init__(self, message: str, needed: int, budget: int) -> None:
        super().__init__(message)
        self.needed, self.budget = needed, budget
        self.short_by = needed - budget


@dataclass(frozen=True)
class MemoryStats:
    """Counters of the tensor manager (totals, or one step's deltas from ``release_step``).

    ``resident_bytes_peak``: most bytes of arena regions (resident ops and fetches in flight)
    at any moment. ``hits``: uses whose op was resident before (fetched ahead and complete, or
    kept from an earlier use); ``late``: prefetched but still in flight when needed;
    ``misses``: fetched on demand. ``stall_s``: time ``ensure`` waited; ``busy_s``: host time in
    the manager's calls (bookkeeping, issuing copies, and the stalls). ``written_back_bytes``:
    device-to-host bytes (write-backs, and gradients with the host-updated optimizer)."""

    budget_bytes: int | None = None
    resident_bytes: int = 0
    resident_bytes_peak: int = 0
    fetched_bytes: int = 0
    written_back_bytes: int = 0
    fetches: int = 0
    write_backs: int = 0
    evictions: int = 0
    hits: int = 0
    late: int = 0
    misses: int = 0
    stall_s: float = 0.0
    busy_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.late + self.misses
        return self.hits / uses if uses else 1.0

    def since(self, before: MemoryStats, peak: int) -> MemoryStats:
        """The counters accumulated since ``before``, with ``peak`` as the peak."""
        kw = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)
              if f.name not in ("budget_bytes", "resident_bytes", "resident_bytes_peak")}
        return MemoryStats(self.budget_bytes, self.resident_bytes, peak, **kw)


@dataclass(frozen=True)
class MemoryAudit:
    """An independent count of where the owned ops' tensors live, from walking the modules and
    optimizer states (not the store's books): ``arena_tensor_bytes`` of tensors whose storage is
    the arena, ``stray`` tensors that are neither in the arena nor in their op's host home."""

    capacity: int
    arena_region_bytes: int
    arena_tensor_bytes: int
    resident_ops: int
    stray: tuple[str, ...]


def optim_state_keys(name: str, momentum: float) -> tuple[str, ...]:
    """The per-parameter optimizer state tensors that get a slot (scalars such as AdamW's
    ``step`` stay where torch puts them, a CPU tensor)."""
    if name == "adamw":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if momentum != 0 else ()


def op_layout(module: nn.Module, state_keys: Sequence[str], align: int) -> OpLayout:
    """An op's layout: its parameters, its buffers, then each parameter's optimizer state."""
    params = list(module.named_parameters())
    entries = [("param", n, i, p.dtype, tuple(p.shape)) for i, (n, p) in enumerate(params)]
    entries += [("buffer", n, -1, b.dtype, tuple(b.shape)) for n, b in module.named_buffers()]
    entries += [("optim", k, i, p.dtype, tuple(p.shape)) for i, (_, p) in enumerate(params) for k in state_keys]
    slots = list(entries)
    return OpLayout.build(slots, align) if slots else OpLayout((), 0)


def device_bytes(layout: OpLayout, optim_on_host: bool) -> int:
    """Bytes of an op that go to the device: its whole layout, or (optimizer on the host) the
    weights and buffers, which come first in it."""
    optim = [s.offset for s in layout.slots if s.kind == "optim"]
    return optim[0] if optim_on_host and optim else layout.nbytes


class OpPlacement:
    """Where one owned op lives: its module, optimizer, layout, host home and arena offset."""

    def __init__(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer, layout: OpLayout,
                 host: torch.Tensor, optim_on_host: bool = False) -> None:
        self.op_id, self.module, self.opt, self.layout, self.host = op_id, module, opt, layout, host
        self.optim_on_host = optim_on_host
        self.nbytes = device_bytes(layout, optim_on_host)
        self._host_views: list[torch.Tensor] | None = None
        self.params = list(module.parameters())
        self.buffer_owner = {}
        for name, _ in module.named_buffers():
            prefix, _, leaf = name.rpartition(".")
            self.buffer_owner[name] = (module.get_submodule(prefix) if prefix else module, leaf)
        self.state = HOST
        self.offset = -1
        self.fetch: Handle | None = None  # the host -> arena copy in flight
        self.host_pending: Handle | None = None  # the arena -> host write-back in flight
        self.dirty = False
        self.settled = False  # every optimizer state slot is a view of where the op lives
        self.last_use = -1

    def host_views(self) -> list[torch.Tensor]:
        """The slots' tensors over the host home (made once: the home never moves)."""
        if self._host_views is None:
            self._host_views = [slot.view(self.host) for slot in self.layout.slots]
        return self._host_views

    def point(self, buf: torch.Tensor, base: int) -> None:
        """Make the module's tensors and its optimizer state views of ``buf`` from ``base``
        (the optimizer state of an op updated on the host stays in its host home)."""
        settled = True
        on_host = buf is self.host
        host = self.host_views() if on_host or self.optim_on_host else None
        for i, slot in enumerate(self.layout.slots):
            if on_host or (slot.kind == "optim" and self.optim_on_host):
                view = host[i]
            else:
                view = slot.view(buf, base)
            if slot.kind == "param":
                self.params[slot.index].data = view
            elif slot.kind == "buffer":
                owner, leaf = self.buffer_owner[slot.name]
                owner._buffers[leaf] = view
            else:
                st = self.opt.state.get(self.params[slot.index])
                if st is not None and st.get(slot.name) is not None:
                    st[slot.name] = view
                else:
                    settled = False
        self.settled = settled

    def settle(self, buf: torch.Tensor, base: int) -> None:
        """Move optimizer state that torch created lazily (first step) into its slots."""
        settled = True
        for i, slot in enumerate(self.layout.slots):
            if slot.kind != "optim":
                continue
            st = self.opt.state.get(self.params[slot.index])
            t = None if st is None else st.get(slot.name)
            if t is None:
                settled = False
                continue
            view = self.host_views()[i] if self.optim_on_host or buf is self.host else slot.view(buf, base)
            if t.data_ptr() != view.data_ptr():
                view.copy_(t)
                st[slot.name] = view
        self.settled = settled
