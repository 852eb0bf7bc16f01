"""The virtualized store behind the tensor manager: host homes, the device arena, prefetch.

:class:`VirtualStore` keeps, for each op a process owns, its placement (:class:`memory.OpPlacement`):
in host memory, being fetched, or resident in the :class:`memory_arena.Arena`; it decides what
is fetched ahead and what is evicted, and issues the copies. See :mod:`pipeline.memory` for the
protocol (``prefetch`` / ``ensure`` / ``release_step``), the policies and the physics.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from .memory import (FETCHING, HOST, RESIDENT, MemoryAudit, MemoryBudgetError, MemoryStats, OpPlacement,
                     op_layout)
from .memory_arena import Arena, Handle, alignment_for, host_buffer, make_copier
from .memory_settings import MemorySettings

__all__ = ["VirtualStore"]

_MIB = float(2**20)


def _timed(fn):
    """A public call: under the store's lock (the runtime may call from more than one thread),
    its host time counted in ``busy_s`` (nested calls once)."""

    @functools.wraps(fn)
    def wrapper(self: VirtualStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._depth:
                return fn(self, *args, **kwargs)
            self._depth = 1
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.copier.flush()  # the copies this call issued start now, in one hand-over
                self._totals["busy_s"] += time.perf_counter() - t0
                self._depth = 0

    return wrapper


class VirtualStore:
    """Host homes and a device arena for the ops of one process (see the module docstring)."""

    def __init__(self, settings: MemorySettings, device: torch.device, state_keys: Sequence[str]) -> None:
        self.settings = settings
        self.device = device
        self.state_keys = tuple(state_keys)
        self.host_update = settings.optimizer == "host"
        self.align = alignment_for(device)
        self.arena = Arena(settings.budget_for(device), device, self.align)
        self.copier = make_copier(device, settings.cpu_copies)
        self.ops: dict[str, OpPlacement] = {}
        self.future: list[frozenset[str]] = []
        self.pinned: set[str] = set()
        self.in_use: set[str] = set()  # handed out this step: in an autograd graph, must not move
        self.ahead: set[str] = set()  # fetched ahead and not used yet
        self.in_flight: list[tuple[OpPlacement, Handle]] = []
        self._tick = 0
        self._blocked = False  # prefetch stopped at the in-flight limit: pump again later
        self._totals: dict[str, Any] = {f.name: 0 for f in fields(MemoryStats)
                                        if f.name not in ("budget_bytes", "resident_bytes", "resident_bytes_peak")}
        self._totals["stall_s"] = self._totals["busy_s"] = 0.0
        self._depth = 0  # nesting of timed calls (only the outermost one counts)
        self._lock = threading.RLock()
        self._peak = 0
        self._step_peak = 0
        self._at_release = self.stats()

    # -- ownership -----------------------------------------------------------------------
    @_timed
    def add(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer,
            state: dict[str, torch.Tensor] | None = None) -> None:
        """Give an op (module and optimizer on the host) a host home; ``state`` (flat, as
        exported) overrides its tensors."""
        layout = op_layout(module, self.state_keys, self.align)
        host = host_buffer(layout.nbytes, self.settings.host_memory, self.device)
        if layout.nbytes:
            host.zero_()
        rec = OpPlacement(op_id, module, opt, layout, host, self.host_update)
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

    @_timed
    def remove(self, op_id: str) -> None:
        """Forget an op (after :meth:`export`); its arena region is freed."""
        rec = self.ops.pop(op_id)
        if rec.state != HOST and rec.nbytes:
            self._complete(rec)
            self.arena.free(op_id)
        for s in (self.pinned, self.in_use, self.ahead):
            s.discard(op_id)

    @_timed
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
        if self._blocked and any(h.done() for _, h in self.in_flight):
            self._pump()  # a copy finished: room under the in-flight cap for the next fetch

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
            if g is not None and g.device.type != "cpu":  # (a CPU gradient is in host memory already)
                host_g = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.settings.host_memory == "pinned")
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
    @_timed
    def stats(self) -> MemoryStats:
        return MemoryStats(self.arena.capacity, self.arena.used, self._peak, **self._totals)

    @_timed
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

    @_timed
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

    def _victim(self, limit: float | None, keep: Collection[str]) -> OpPlacement | None:
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

    def _hole_victim(self, n: int, limit: float | None, keep: Collection[str]) -> OpPlacement | None:
        """Belady: among the ops its rule ranks first (the same next use, the furthest), one
        whose region with the free bytes around it holds ``n`` bytes (least recently used
        first): evicting it costs no more than evicting the rule's own choice, and it spares
        moving other ops' bytes around (compaction)."""
        if self.settings.policy != "belady":
            return None
        cands = [r for r in self.ops.values()
                 if r.state == RESIDENT and r.nbytes and r.op_id not in self.pinned and r.op_id not in keep]
        if not cands:
            return None
        far = max(self._next_use(r.op_id) for r in cands)
        if limit is not None and not far > limit:
            return None
        gap_end = {off + size: size for off, size in self.arena.gaps()}  # gap that ends at an offset
        gap_start = dict(self.arena.gaps())  # offset -> size of the gap starting there
        fits = []
        for r in cands:
            if self._next_use(r.op_id) != far:
                continue
            off, size = self.arena.regions[r.op_id]
            if gap_end.get(off, 0) + size + gap_start.get(off + size, 0) >= n:
                fits.append(r)
        return min(fits, key=lambda r: r.last_use) if fits else None

    def _make_room(self, rec: OpPlacement, limit: float | None, keep: Collection[str] = ()) -> int | None:
        """Place ``rec`` in the arena, evicting as the policy says; ``None`` when a prefetch
        (``limit`` set) would have to evict something needed sooner."""
        n = rec.nbytes
        while True:
            off = self.arena.allocate(rec.op_id, n)
            if off is not None:
                return off
            hole = self._hole_victim(n, limit, keep)
            if hole is not None:
                self._evict(hole)
                continue
            # Compacting moves resident ops on this thread after draining the copies: only for
            # a fetch the step waits for anyway, or between steps (nothing in use).
            compactable = limit is None or not self.in_use
            if compactable and self.arena.capacity - self.arena.used >= n and self._compact(n, drain=limit is None):
                continue
            victim = self._victim(limit, keep)
            if victim is None and limit is None and any(r.state == FETCHING and r.op_id not in self.pinned
                                                        for r in self.ops.values()):
                self._drain()  # fetches ahead finish and become candidates
                victim = self._victim(limit, keep)
            if victim is None:
                if limit is not None:
                    return None
                pinned = sum(self.ops[o].nbytes for o in self.pinned)
                free = self.arena.capacity - self.arena.used
                raise MemoryBudgetError(
                    f"memory.device_budget_bytes: no region of {n} bytes for op {rec.op_id!r}: {free} bytes are free "
                    f"but split around {len(self.in_use)} ops already in use this step (the step's ops take "
                    f"{pinned} bytes of a budget of {self.arena.capacity}); ensure() a step's ops before using "
                    "any of them, or raise memory.device_budget_bytes", pinned, self.arena.capacity)
            self._evict(victim)

    def _compact(self, need: int, drain: bool) -> bool:
        """Slide movable regions down until a gap of ``need`` bytes opens; whether anything
        moved. Ops in use (in an autograd graph) stay where they are, and so do ops being
        fetched unless ``drain`` (wait for every copy first: a demand fetch waits anyway);
        write-backs in flight read regions that are free now, so they finish first."""
        if drain:
            self._drain()
        for rec, h in self.in_flight:
            if rec.host_pending is h:
                h.wait()
        fixed = self.in_use | {o for o, r in self.ops.items() if r.state == FETCHING}
        moves = self.arena.plan_compaction(fixed, need)
        for op_id, off in sorted(moves.items(), key=lambda kv: kv[1]):
            self.arena.move(op_id, off)
            rec = self.ops[op_id]
            rec.offset = off
            rec.point(self.arena.buffer, off)
        return bool(moves)

    def _start_fetch(self, rec: OpPlacement, off: int) -> None:
        rec.offset = off
        rec.state = FETCHING
        rec.fetch = self.copier.copy(self.arena.buffer[off : off + rec.nbytes], rec.host[: rec.nbytes])
        self.in_flight.append((rec, rec.fetch))
        self._totals["fetched_bytes"] += rec.nbytes
        self._totals["fetches"] += 1
        self._peak = max(self._peak, self.arena.used)
        self._step_peak = max(self._step_peak, self.arena.used)

    def _complete(self, rec: OpPlacement) -> None:
        """Wait for the op's fetch and point its tensors at its region."""
        if rec.state != FETCHING:
            return
        rec.fetch.wait()
        rec.fetch = None
        rec.point(self.arena.buffer, rec.offset)
        rec.state = RESIDENT
        rec.dirty = False

    def _write_back(self, rec: OpPlacement) -> Handle:
        h = self.copier.copy(rec.host[: rec.nbytes], self.arena.buffer[rec.offset : rec.offset + rec.nbytes])
        rec.host_pending = h
        rec.dirty = False
        self.in_flight.append((rec, h))
        self._totals["written_back_bytes"] += rec.nbytes
        self._totals["write_backs"] += 1
        return h

    def _evict(self, rec: OpPlacement) -> None:
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
