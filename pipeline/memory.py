"""The virtualized store behind the tensor manager: host homes, a bounded device arena, prefetch.

Every op owned by a process has a home in host memory (:func:`memory_arena.host_buffer`:
pinned on CUDA) holding its weights, buffers and optimizer state in one :class:`OpLayout`. An
op is *resident* when the same bytes sit in a region of the device :class:`Arena` and the
module's parameters, buffers and optimizer state are views of that region; otherwise they are
views of the host home (an op in host memory can be exported, or migrated, without touching
the device). The arena has the budget's size, so the device tier can never hold more.

The engine says what it will need: :meth:`VirtualStore.prefetch` takes the op sets of the
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
stays in the host home and the host runs the update (:meth:`VirtualStore.to_host`): 4 bytes of
weights per parameter go to the device and 4 of gradients come back, every step the op is used
(the device copy is stale after the update), and the host's update time is on the critical
path of a synchronous step. Gradients are not in the arena: autograd allocates them during the
backward and the step frees them.
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from .memory_arena import Arena, Handle, OpLayout, alignment_for, host_buffer, make_copier
from .memory_settings import MemorySettings

__all__ = ["MemoryStats", "MemoryAudit", "MemoryBudgetError", "VirtualStore", "optim_state_keys", "op_layout"]

HOST, FETCHING, RESIDENT = "host", "fetching", "resident"
_MIB = float(2**20)


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


class _Op:
    """One owned op's placement."""

    def __init__(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer, layout: OpLayout,
                 host: torch.Tensor, optim_on_host: bool = False) -> None:
        self.op_id, self.module, self.opt, self.layout, self.host = op_id, module, opt, layout, host
        self.optim_on_host = optim_on_host
        # bytes that go to the device: the whole layout, or (optimizer on the host) the
        # weights and buffers, which come first in it
        optim = [s.offset for s in layout.slots if s.kind == "optim"]
        self.nbytes = optim[0] if optim_on_host and optim else layout.nbytes
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

    def point(self, buf: torch.Tensor, base: int) -> None:
        """Make the module's tensors and its optimizer state views of ``buf`` from ``base``
        (the optimizer state of an op updated on the host stays in its host home)."""
        settled = True
        for slot in self.layout.slots:
            view = slot.view(self.host, 0) if slot.kind == "optim" and self.optim_on_host else slot.view(buf, base)
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
        for slot in self.layout.slots:
            if slot.kind != "optim":
                continue
            st = self.opt.state.get(self.params[slot.index])
            t = None if st is None else st.get(slot.name)
            if t is None:
                settled = False
                continue
            view = slot.view(self.host, 0) if self.optim_on_host else slot.view(buf, base)
            if t.data_ptr() != view.data_ptr():
                view.copy_(t)
                st[slot.name] = view
        self.settled = settled


def _timed(fn):
    """Count the host time of a public call in ``busy_s`` (nested calls once)."""

    @functools.wraps(fn)
    def wrapper(self: VirtualStore, *args: Any, **kwargs: Any) -> Any:
        if self._depth:
            return fn(self, *args, **kwargs)
        self._depth = 1
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._totals["busy_s"] += time.perf_counter() - t0
            self._depth = 0

    return wrapper


class VirtualStore:
    """Host homes and a device arena for the ops of one process (see the module docstring)."""

    def __init__(self, settings: MemorySettings, device: torch.device, state_keys: Sequence[str]) -> None:
        assert settings.device_budget_bytes is not None
        self.settings = settings
        self.device = device
        self.state_keys = tuple(state_keys)
        self.host_update = settings.optimizer == "host"
        self.align = alignment_for(device)
        self.arena = Arena(int(settings.device_budget_bytes), device, self.align)
        self.copier = make_copier(device)
        self.ops: dict[str, _Op] = {}
        self.future: list[frozenset[str]] = []
        self.pinned: set[str] = set()
        self.in_use: set[str] = set()  # handed out this step: in an autograd graph, must not move
        self.ahead: set[str] = set()  # fetched ahead and not used yet
        self.in_flight: list[tuple[_Op, Handle]] = []
        self._tick = 0
        self._blocked = False  # prefetch stopped at the in-flight limit: pump again later
        self._totals: dict[str, Any] = {f.name: 0 for f in fields(MemoryStats)
                                        if f.name not in ("budget_bytes", "resident_bytes", "resident_bytes_peak")}
        self._totals["stall_s"] = self._totals["busy_s"] = 0.0
        self._depth = 0  # nesting of timed calls (only the outermost one counts)
        self._peak = 0
        self._step_peak = 0
        self._at_release = self.stats()

    # -- ownership -----------------------------------------------------------------------
    def add(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer,
            state: dict[str, torch.Tensor] | None = None) -> None:
        """Give an op (module and optimizer on the host) a host home; ``state`` (flat, as
        exported) overrides its tensors."""
        layout = op_layout(module, self.state_keys, self.align)
        host = host_buffer(layout.nbytes, self.settings.host_memory, self.device)
        if layout.nbytes:
            host.zero_()
        rec = _Op(op_id, module, opt, layout, host, self.host_update)
        if rec.nbytes > self.arena.capacity:
            raise self._budget_error(f"op {op_id!r} alone", rec.nbytes)
        params = rec.params
        with torch.no_grad():
            for slot in layout.slots:
                view = slot.view(host)
                if slot.kind == "param":
                    src = state[f"param/{slot.name}"] if state is not None else params[slot.index]
                    view.copy_(src)
                elif slot.kind == "buffer":
                    src = state[f"buffer/{slot.name}"] if state is not None else module.get_buffer(slot.name)
                    view.copy_(src)
        if state is not None:
            for i, p in enumerate(params):
                entry = {}
                for key, t in state.items():
                    if key.startswith(f"optim/{i}/"):
                        name = key.split("/", 2)[2]
                        if name in self.state_keys:
                            entry[name] = t  # copied into the slot by point() below
                        else:
                            entry[name] = t.detach().clone().cpu()  # scalars (AdamW's step) stay on the host
                if entry:
                    opt.state[p] = entry
            for slot in layout.slots:  # copy optimizer state into the host home first
                if slot.kind == "optim":
                    t = opt.state.get(params[slot.index], {}).get(slot.name)
                    if t is not None:
                        slot.view(host).copy_(t)
        rec.point(host, 0)
        if not rec.nbytes:  # nothing to place (an identity op): always resident
            rec.state = RESIDENT
        self.ops[op_id] = rec

    def remove(self, op_id: str) -> None:
        """Forget an op (after :meth:`export`); its arena region is freed."""
        rec = self.ops.pop(op_id)
        if rec.state != HOST and rec.nbytes:
            self._complete(rec)
            self.arena.free(op_id)
        for s in (self.pinned, self.in_use, self.ahead):
            s.discard(op_id)

    def export(self, op_id: str, copy: bool = True) -> dict[str, torch.Tensor]:
        """The op's flat state as host tensors, from its host home brought up to date: copies
        (``copy``; a snapshot, and tensors that ``torch.save`` accepts) or views of the home
        (for an op given up: its home goes with it, nothing is copied)."""
        rec = self.ops[op_id]
        if rec.state == FETCHING:
            self._complete(rec)
        if rec.state == RESIDENT and rec.dirty and rec.nbytes:
            self._write_back(rec).synchronize()
        if rec.host_pending is not None:
            rec.host_pending.synchronize()
            rec.host_pending = None
        state: dict[str, torch.Tensor] = {}
        host = rec.host
        for slot in rec.layout.slots:
            if slot.kind in ("param", "buffer"):
                state[f"{slot.kind}/{slot.name}"] = slot.view(host)
        for i, p in enumerate(rec.params):
            st = rec.opt.state.get(p, {})
            for key, t in sorted(st.items()):
                if not isinstance(t, torch.Tensor):
                    continue
                if key in self.state_keys:
                    slot = next(s for s in rec.layout.slots if s.kind == "optim" and s.index == i and s.name == key)
                    t = slot.view(host)
                state[f"optim/{i}/{key}"] = t.detach()
        return {k: t.clone() for k, t in state.items()} if copy else state

    # -- the step's protocol -----------------------------------------------------------------
    @_timed
    def prefetch(self, upcoming: Sequence[Collection[str]]) -> None:
        """Set the known future (op sets of the coming steps, the step about to run first) and
        start fetching it in the background as far as the budget allows."""
        self.future = [frozenset(s) for s in upcoming]
        self._pump()

    @_timed
    def ensure(self, op_ids: Collection[str]) -> None:
        """Pin ``op_ids`` for the current step and wait until they are resident."""
        need = [o for o in dict.fromkeys(op_ids) if o in self.ops]
        fresh = [o for o in need if o not in self.pinned or self.ops[o].state != RESIDENT]
        total = sum(self.ops[o].nbytes for o in set(self.pinned) | set(need))
        if total > self.arena.capacity:
            raise self._budget_error(f"the {len(set(self.pinned) | set(need))} ops needed at once", total)
        self.pinned.update(need)
        t0 = time.perf_counter()
        waited = False
        for o in fresh:
            rec = self.ops[o]
            self._tick += 1
            rec.last_use = self._tick
            if rec.nbytes == 0 or rec.state == RESIDENT:
                self._totals["hits"] += 1
            elif rec.state == FETCHING:
                self._totals["late" if not rec.fetch.done() else "hits"] += 1
            else:
                self._totals["misses"] += 1
                waited = True
                self._start_fetch(rec, self._make_room(rec, limit=None))
            self.ahead.discard(o)
        for o in fresh:
            rec = self.ops[o]
            if rec.state == FETCHING:
                waited = waited or not rec.fetch.done()
                self._complete(rec)
        if waited:
            self._totals["stall_s"] += time.perf_counter() - t0

    @_timed
    def use(self, op_id: str, mutates: bool) -> None:
        """The op is about to be used (forward, backward or step): resident, pinned, immovable."""
        if op_id not in self.pinned or self.ops[op_id].state != RESIDENT:
            self.ensure([op_id])
        rec = self.ops[op_id]
        self.in_use.add(op_id)
        if mutates and rec.buffer_owner:
            rec.dirty = True  # running statistics may change in a forward pass
        if self._blocked:
            self._pump()

    @_timed
    def stepped(self, op_id: str) -> None:
        """The op took an optimizer step: its state changed (dirty) and new state moves in."""
        rec = self.ops[op_id]
        rec.dirty = True
        if not rec.settled and rec.nbytes:
            rec.settle(self.arena.buffer, rec.offset)

    @_timed
    def to_host(self, op_id: str) -> list[torch.Tensor | None]:
        """Optimizer on the host: bring the op's gradients to host memory, write back its
        buffers if they changed, and leave the device (the host update makes the device copy
        stale). Returns the host gradients, in parameter order, for the caller to step with."""
        rec = self.ops[op_id]
        grads = []
        for p in rec.params:
            g = p.grad
            if g is not None:
                host_g = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.device.type == "cuda"
                                     and self.settings.host_memory == "pinned")
                host_g.copy_(g)  # synchronous: the update below reads it at once
                self._totals["written_back_bytes"] += host_g.nbytes
                g = host_g
            grads.append(g)
            p.grad = None  # the device gradient is freed; the caller sets the host one
        if rec.nbytes and rec.state != HOST:
            self._complete(rec)
            if rec.dirty and rec.buffer_owner:
                self._write_back(rec).synchronize()
            rec.host_pending = None
            rec.dirty = False
            rec.point(rec.host, 0)
            self.arena.free(op_id)
            rec.state, rec.offset = HOST, -1
            self._totals["evictions"] += 1
        for s in (self.pinned, self.in_use, self.ahead):
            s.discard(op_id)
        return grads

    @_timed
    def host_stepped(self, op_id: str) -> None:
        """The op took its optimizer step on the host: new optimizer state moves into its home."""
        rec = self.ops[op_id]
        if not rec.settled:
            rec.settle(rec.host, 0)

    @_timed
    def release_step(self, advance: bool = True) -> MemoryStats:
        """Unpin the step's ops, move the future on (``advance``) and keep prefetching; returns
        the counters of the step since the last release."""
        self.pinned.clear()
        self.in_use.clear()
        if advance and self.future:
            self.future.pop(0)
        self._pump()
        now = self.stats()
        step = now.since(self._at_release, self._step_peak)
        self._at_release = now
        self._step_peak = self.arena.used
        return step

    # -- figures ---------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        return MemoryStats(self.arena.capacity, self.arena.used, self._peak, **self._totals)

    def audit(self) -> MemoryAudit:
        arena_bytes, stray, regions = 0, [], self.arena.regions
        base = self.arena.buffer.data_ptr()
        for op_id, rec in self.ops.items():
            tensors = [(f"param/{n}", p) for n, p in rec.module.named_parameters()]
            tensors += [(f"buffer/{n}", b) for n, b in rec.module.named_buffers()]
            tensors += [(f"optim/{i}/{k}", t) for i, p in enumerate(rec.params)
                        for k, t in rec.opt.state.get(p, {}).items() if isinstance(t, torch.Tensor) and t.dim() > 0]
            for name, t in tensors:
                if self.arena.holds(t):
                    off, n = regions.get(op_id, (-1, 0))
                    start = t.data_ptr() - base
                    if not (off <= start and start + t.nbytes <= off + n):
                        stray.append(f"{op_id}.{name} (in the arena outside its region)")
                    arena_bytes += t.nbytes
                elif t.untyped_storage().data_ptr() != rec.host.untyped_storage().data_ptr() and t.nbytes:
                    stray.append(f"{op_id}.{name}")
        return MemoryAudit(self.arena.capacity, self.arena.used, arena_bytes,
                           sum(r.state == RESIDENT for r in self.ops.values()), tuple(stray))

    def close(self) -> None:
        self._drain()
        self.copier.close()

    # -- internals ---------------------------------------------------------------------------
    def _budget_error(self, what: str, needed: int) -> MemoryBudgetError:
        b = self.arena.capacity
        return MemoryBudgetError(
            f"memory.device_budget_bytes: {what} need {needed} bytes ({needed / _MIB:.2f} MiB) of weights, "
            f"buffers and optimizer state resident, but the budget is {b} bytes ({b / _MIB:.2f} MiB): "
            f"short by {needed - b} bytes; raise memory.device_budget_bytes to at least {needed}", needed, b)

    def _next_use(self, op_id: str) -> float:
        for i, s in enumerate(self.future):
            if op_id in s:
                return i
        return math.inf

    def _victim(self, limit: float | None, keep: Collection[str]) -> _Op | None:
        """The op to evict for a fetch needed at future index ``limit`` (``None``: now, on
        demand), never a pinned one or one in ``keep``."""
        cands = [r for r in self.ops.values()
                 if r.state == RESIDENT and r.nbytes and r.op_id not in self.pinned and r.op_id not in keep]
        if not cands:
            return None
        if self.settings.policy == "belady":
            best = max(cands, key=lambda r: (self._next_use(r.op_id), -r.last_use))
            if limit is not None and not self._next_use(best.op_id) > limit:
                return None  # everything resident is needed no later than the op being fetched
            return best
        lru = [r for r in cands if r.op_id not in self.ahead]
        if not lru and limit is None:  # a demand fetch may take the place of an op fetched ahead
            lru = cands
        return min(lru, key=lambda r: r.last_use) if lru else None

    def _make_room(self, rec: _Op, limit: float | None, keep: Collection[str] = ()) -> int | None:
        """Place ``rec`` in the arena, evicting as the policy says; ``None`` when a prefetch
        (``limit`` set) would have to evict something needed sooner."""
        n = rec.nbytes
        while True:
            off = self.arena.allocate(rec.op_id, n)
            if off is not None:
                return off
            if self.arena.capacity - self.arena.used >= n and self._compact():
                continue
            victim = self._victim(limit, keep)
            if victim is None and limit is None and any(r.state == FETCHING and r.op_id not in self.pinned
                                                        for r in self.ops.values()):
                self._drain()  # fetches ahead finish and become candidates
                victim = self._victim(limit, keep)
            if victim is None:
                if limit is not None:
                    return None
                raise self._budget_error(f"op {rec.op_id!r} with the ops pinned now (no region fits: fragmented "
                                         f"around {len(self.in_use)} ops in use)", self.arena.used + n)
            self._evict(victim)

    def _compact(self) -> bool:
        """Slide movable regions down so free bytes join up; whether anything moved."""
        self._drain()
        moves = self.arena.plan_compaction(self.in_use)
        for op_id, off in sorted(moves.items(), key=lambda kv: kv[1]):
            self.arena.move(op_id, off)
            rec = self.ops[op_id]
            rec.offset = off
            rec.point(self.arena.buffer, off)
        return bool(moves)

    def _start_fetch(self, rec: _Op, off: int) -> None:
        rec.offset = off
        rec.state = FETCHING
        rec.fetch = self.copier.copy(self.arena.buffer[off : off + rec.nbytes], rec.host[: rec.nbytes])
        self.in_flight.append((rec, rec.fetch))
        self._totals["fetched_bytes"] += rec.nbytes
        self._totals["fetches"] += 1
        self._peak = max(self._peak, self.arena.used)
        self._step_peak = max(self._step_peak, self.arena.used)

    def _complete(self, rec: _Op) -> None:
        """Wait for the op's fetch and point its tensors at its region."""
        if rec.state != FETCHING:
            return
        rec.fetch.wait()
        rec.fetch = None
        rec.point(self.arena.buffer, rec.offset)
        rec.state = RESIDENT
        rec.dirty = False

    def _write_back(self, rec: _Op) -> Handle:
        h = self.copier.copy(rec.host[: rec.nbytes], self.arena.buffer[rec.offset : rec.offset + rec.nbytes])
        rec.host_pending = h
        rec.dirty = False
        self.in_flight.append((rec, h))
        self._totals["written_back_bytes"] += rec.nbytes
        self._totals["write_backs"] += 1
        return h

    def _evict(self, rec: _Op) -> None:
        self._complete(rec)
        if rec.dirty:
            self._write_back(rec)  # in stream order before any fetch that reuses the region
        rec.point(rec.host, 0)  # its host home: read only after host_pending is synchronized
        self.arena.free(rec.op_id)
        rec.state, rec.offset = HOST, -1
        self.ahead.discard(rec.op_id)
        self._totals["evictions"] += 1

    def _drain(self) -> None:
        """Wait for every copy in flight (before the host thread moves arena bytes itself)."""
        for rec, h in self.in_flight:
            h.synchronize()
            if rec.host_pending is h:
                rec.host_pending = None
        self.in_flight.clear()
        for rec in self.ops.values():
            if rec.state == FETCHING:
                self._complete(rec)

    def _pump(self) -> None:
        """Retire finished copies and issue fetches for the coming steps while the budget and
        the in-flight limit allow."""
        keep = []
        for rec, h in self.in_flight:
            if h.done():
                if rec.host_pending is h:
                    rec.host_pending = None
            else:
                keep.append((rec, h))
        self.in_flight = keep
        self._blocked = False
        if self.settings.policy == "on_demand":
            return
        horizon = self.future[: self.settings.prefetch_depth + 1]
        for idx, ops in enumerate(horizon):
            for op_id in sorted(ops):
                rec = self.ops.get(op_id)
                if rec is None or rec.state != HOST or rec.nbytes == 0:
                    continue
                if len(self.in_flight) >= self.settings.max_in_flight:
                    self._blocked = True
                    return
                keep_set = ops if self.settings.policy == "lru" else ()
                off = self._make_room(rec, limit=idx, keep=keep_set)
                if off is None:
                    return  # the budget is full of ops needed no later than this one
                self._start_fetch(rec, off)
                self.ahead.add(op_id)
