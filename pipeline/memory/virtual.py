"""The virtual store: ops live in host homes and a bounded device arena (a budget is set).

:class:`VirtualStore` is the :class:`~pipeline.memory.store.Store` interface over a
:class:`~pipeline.memory.working_set.WorkingSet`: it gives each op a host home, answers the
step's protocol (``prefetch`` / ``ensure`` / ``use`` / the optimizer step / ``release_step``,
see :mod:`pipeline.memory`), runs the host side of the update when the optimizer state lives
there, and reports its counters and audit. Every public call holds one lock (the runtime may
call from more than one thread) and counts its host time in ``busy_s``, except :meth:`use` of an
op already in use this step: nothing can move such an op until the stepping thread itself
releases the step, so it returns at once (a fetch ahead that finished meanwhile is pumped by the
next call that takes the lock).
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .arena import host_buffer
from .errors import budget_error
from .placement import FETCHING, HOST, RESIDENT, OpPlacement
from .settings import MemorySettings
from .state import OpState, op_layout
from .stats import MemoryAudit, MemoryStats, audit
from .working_set import WorkingSet

__all__ = ["VirtualStore"]


def _timed(fn):
    """A public call: under the store's lock, its host time counted in ``busy_s`` (nested calls once)."""

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
                self.counters.add(busy_s=time.perf_counter() - t0)
                self._depth = 0

    return wrapper


def _in_host_memory(t: torch.Tensor) -> bool:
    """Whether a gradient is in host memory already (a CPU tensor), or must be copied there."""
    return t.device.type == "cpu"


class _GradCopies:
    """An op's gradients on their way to host memory: the copies' handles, and the device
    gradients they read, kept alive until the copies are done (the caching allocator could
    otherwise hand their memory to the next kernels while the copy stream still reads it)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.sources: list[torch.Tensor] = []

    def done(self) -> None:
        """Block until every copy landed, then let the device gradients go."""
        for h in self.handles:
            h.synchronize()
        self.handles, self.sources = [], []


def _home_update(rec: OpPlacement, host_step: Callable[[str, list], None],
                 copies: _GradCopies | None = None) -> Callable[[], None]:
    """An op's update at home, as one job: once its gradients' copies to host memory landed
    (``copies``), its optimizer step with the gradients it has now (taken off its parameters:
    the job owns them), then optimizer state that torch created lazily (its first step) into
    the home's slots."""
    grads = []
    for p in rec.params:
        grads.append(p.grad)
        p.grad = None

    def run() -> None:
        if copies is not None:
            copies.done()
        host_step(rec.op_id, grads)
        if not rec.settled:
            rec.settle(rec.host, 0)

    return run


class VirtualStore(WorkingSet):
    """Host homes and a device arena for the ops of one process (see the module docstring)."""

    virtual = True
    module_device = torch.device("cpu")  # an op's module is built in host memory, then given a home

    def __init__(self, settings: MemorySettings, device: torch.device, state_keys: Sequence[str]) -> None:
        super().__init__(settings, device)
        self.state_keys = tuple(state_keys)
        self._tick = 0
        self._updating_home: set[str] = set()  # ops of the step being updated on the host
        self._grad_copies: dict[str, _GradCopies] = {}  # their gradients' copies to host memory, in flight
        self._depth = 0  # nesting of timed calls (only the outermost one counts)
        self._lock = threading.RLock()

    # -- ownership -----------------------------------------------------------------------
    @_timed
    def add(self, op_id: str, module: nn.Module, opt: torch.optim.Optimizer,
            state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Give an op (module and optimizer on the host) a host home; ``state`` (flat, as
        exported) overrides its tensors."""
        layout = op_layout(module, self.state_keys, self.align)
        rec = OpPlacement(op_id, module, opt, layout, host_buffer(layout.nbytes, self.settings.host_memory, self.device),
                          self.settings.state_can_stay_home)
        if rec.nbytes > self.arena.capacity:
            raise budget_error(f"op {op_id!r} alone", rec.nbytes, self.arena.capacity)
        self.ops[op_id] = rec
        try:
            if state is None or not rec.nbytes or not self._arrive(rec, state):
                rec.fill_home(state, self.state_keys)
        except BaseException:
            self.remove(op_id)
            raise
        if not rec.nbytes:  # nothing to place (an identity op): always resident
            rec.state = RESIDENT

    def _arrive(self, rec: OpPlacement, state: Mapping[str, torch.Tensor]) -> bool:
        """An op that arrives from another stage (``state``: on the device under NCCL) lands in
        the arena when a coming step uses it and room can be made without evicting an op needed
        sooner (as a fetch ahead for that step would); its host home is then stale (``dirty``:
        written back if it is ever evicted). Whether it landed there."""
        idx = self._next_use(rec.op_id)
        if idx == math.inf:
            return False
        off = self._place(rec, int(idx), limit=idx, step_ops=self.future[int(idx)])
        if off is None:
            return False
        rec.offset, rec.state = off, RESIDENT
        rec.fill(state, self.state_keys, self.arena.buffer, off)
        rec.dirty = True
        self.ahead.add(rec.op_id)
        self.counters.add(arrived=1)
        self.counters.resident(self.arena.used)
        return True

    @_timed
    def remove(self, op_id: str) -> None:
        """Forget an op (after :meth:`export`); its arena region is freed."""
        self.host_updates.wait(op_id)
        rec = self.ops.pop(op_id)
        if rec.state != HOST and rec.nbytes:
            self._complete(rec)
            self.arena.free(op_id)
        for s in (self.pinned, self.in_use, self.ahead):
            s.discard(op_id)

    @_timed
    def export(self, op_id: str, copy: bool = True) -> OpState:
        """The op's flat state: copies (``copy``; a snapshot from its host home brought up to
        date, host tensors that ``torch.save`` accepts) or, for an op given up, views of where it
        lives: its arena region while resident (it leaves from the device: no write-back, and
        under NCCL no host copy on either side of a move) or else its home."""
        self.host_updates.wait(op_id)
        rec = self.ops[op_id]
        if rec.state == FETCHING:
            self._complete(rec)
        if not copy and rec.state == RESIDENT and rec.nbytes:
            return rec.state_in(self.arena.buffer, rec.offset, copy=False)  # it leaves from the arena
        if rec.state == RESIDENT and rec.dirty and rec.nbytes:
            self._write_back(rec).synchronize()
        if rec.host_pending is not None:
            rec.host_pending.synchronize()
            rec.host_pending = None
        return rec.home_state(copy)

    # -- the step's protocol -----------------------------------------------------------------
    @_timed
    def prefetch(self, upcoming: Sequence[Collection[str]],
                 host_budget: Sequence[float | None] | None = None) -> None:
        """Set the known future (op sets of the coming steps, the step about to run first) and
        start fetching it in the background as far as the budget allows. ``host_budget``: per
        coming step, the parameters the host may step for it (hybrid placement; None: no limit)."""
        self.future = [frozenset(s) for s in upcoming]
        budget = list(host_budget) if host_budget is not None else []
        self.host_budget = (budget + [None] * len(self.future))[: len(self.future)]
        self.running = 0
        self._pump()

    @_timed
    def ensure(self, op_ids: Collection[str]) -> None:
        """Pin ``op_ids`` for the current step and wait until they are resident."""
        need = [o for o in dict.fromkeys(op_ids) if o in self.ops]
        together = set(self.pinned) | set(need)
        total = sum(self.ops[o].nbytes for o in together)
        if total > self.arena.capacity and self.hybrid:
            total = self._shed_state(together)
        fresh = [o for o in need if o not in self.pinned or self.ops[o].state != RESIDENT]
        if total > self.arena.capacity:
            raise budget_error(f"the {len(together)} ops needed at once", total, self.arena.capacity)
        self.pinned.update(need)
        t0 = time.perf_counter()
        waited = False
        for o in fresh:
            rec = self.ops[o]
            self._tick += 1
            rec.last_use = self._tick
            if rec.nbytes == 0 or rec.state == RESIDENT:
                self.counters.add(hits=1)
            elif rec.state == FETCHING:
                self.counters.add(**{"late" if not rec.fetch.done() else "hits": 1})
            else:
                self.counters.add(misses=1)
                waited = True
                self._start_fetch(rec, self._place(rec, 0, limit=None, step_ops=together))
            self.ahead.discard(o)
        for o in fresh:
            rec = self.ops[o]
            if rec.state == FETCHING:
                waited = waited or not rec.fetch.done()
                self._complete(rec)
        if waited:
            self.counters.add(stall_s=time.perf_counter() - t0)

    def use(self, op_id: str, mutates: bool) -> None:
        """The op is about to be used (forward, backward or step): resident, pinned, immovable."""
        if op_id in self.in_use and not self._blocked:  # used this step already: nothing can have moved it
            rec = self.ops[op_id]
            if rec.dirty or not (mutates and rec.buffer_owner):
                return
        self._use(op_id, mutates)

    @_timed
    def _use(self, op_id: str, mutates: bool) -> None:
        if op_id not in self.pinned or self.ops[op_id].state != RESIDENT:
            self.ensure([op_id])
        rec = self.ops[op_id]
        self.in_use.add(op_id)
        if mutates and rec.buffer_owner:
            rec.dirty = True  # running statistics may change in a forward pass
        if self._blocked and any(h.done() for _, h in self.in_flight):
            self._pump()  # a copy finished: room under the in-flight cap for the next fetch

    @_timed
    def prepare_step(self, op_ids: Sequence[str]) -> list[str]:
        """Before the optimizer step of ``op_ids``: each resident and pinned; an op whose update
        runs on the host (its state stayed home) has its gradients in host memory and is back in
        its home (the host update makes the device copy stale). Returns the ops that take a step."""
        stepped = []
        for op_id in op_ids:
            self.use(op_id, mutates=False)
            rec = self.ops[op_id]
            if rec.optim_on_host:
                self._to_host(rec)
                self._updating_home.add(op_id)
                self.counters.add(host_updates=1)
            if rec.optim_on_host or any(p.grad is not None for p in rec.params):
                stepped.append(op_id)
        return stepped

    def updating_home(self) -> frozenset[str]:
        """The ops of the step being prepared whose update runs on the host (after
        :meth:`prepare_step`): :meth:`finish_step` hands them to ``host_step``."""
        return frozenset(self._updating_home)

    @_timed
    def finish_step(self, stepped: Sequence[str], fresh: Sequence[str] = (),
                    host_step: Callable[[str, list], None] | None = None) -> None:
        """After the device's part of the step: the ops' state changed (dirty on the device), and
        optimizer state torch created lazily (``fresh``: the first step) moves into its slots.
        The ops updated at home (:meth:`updating_home`) get their update now: ``host_step(op_id,
        grads)`` (their optimizer step with the gradients taken off their parameters) on the
        host-update threads, then their new state into its slots."""
        for op_id in stepped:
            rec = self.ops[op_id]
            if op_id in self._updating_home:
                if host_step is None:
                    raise RuntimeError(f"op {op_id!r} is updated at home, but no host step was given")
                self.host_updates.submit(op_id, _home_update(rec, host_step, self._grad_copies.pop(op_id, None)))
                continue
            rec.dirty = True
            if not rec.settled and rec.nbytes:
                rec.settle(self.arena.buffer, rec.offset)
        self._updating_home.clear()
        for copies in self._grad_copies.values():  # (ops prepared but not stepped: nothing reads them)
            copies.done()
        self._grad_copies.clear()

    def _shed_state(self, together: set[str]) -> int:
        """Hybrid, when the ops needed at once do not fit with the state some of them keep on
        the device: send those ops home (written back), to come back without it, until they fit;
        returns the bytes the ops then need."""
        for o in sorted(together):
            rec = self.ops[o]
            total = sum(self.ops[x].nbytes for x in together)
            if total <= self.arena.capacity:
                return total
            if not rec.optim_on_host and rec.state != HOST and o not in self.in_use:
                self._evict(rec)
        return sum(self.ops[x].nbytes for x in together)

    def _to_host(self, rec: OpPlacement) -> None:
        """The op's gradients to host memory, its changed buffers written back, the op home.

        A device gradient travels on the copier's write-back stream, after the kernels queued
        so far (its backward): the training thread does not wait for it; the op's update at
        home does (:func:`_home_update`), and nothing else reads the host copy before that
        update (a fetch, export or removal of the op waits for the update)."""
        grads = []
        copies = _GradCopies()
        for p in rec.params:
            g = p.grad
            if g is not None and not _in_host_memory(g):
                host_g = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.settings.host_memory == "pinned")
                copies.handles.append(self.copier.copy(host_g, g))
                copies.sources.append(g)
                self.counters.add(written_back_bytes=host_g.nbytes)
                g = host_g
            elif g is not None and self.host_updates.threads:
                g = g.clone()  # the update runs later: a buffer of the replicas' reduction may be reused by then
            grads.append(g)
            p.grad = None  # the device gradient is freed before the parameter moves home
        if rec.nbytes and rec.state != HOST:
            self._complete(rec)
            if rec.dirty:  # changed buffers, or a home left stale by an arrival in the arena
                self._write_back(rec).synchronize()
            rec.host_pending = None
            rec.dirty = False
            self._go_home(rec)
        for s in (self.pinned, self.in_use, self.ahead):
            s.discard(rec.op_id)
        for p, g in zip(rec.params, grads):
            p.grad = g
        if copies.handles:
            self._grad_copies[rec.op_id] = copies

    @_timed
    def release_step(self, advance: bool = True, ops: Collection[str] | None = None, done: int = 0,
                     in_flight: int = 0) -> MemoryStats:
        """Unpin the step's ops (``ops``: only those, while other subnets in flight keep theirs
        pinned), move the future on (``advance``: its entry ``done`` is over) and keep
        prefetching past the ``in_flight`` subnets still running here; returns the counters
        since the last release."""
        if ops is None:
            self.pinned.clear()
            self.in_use.clear()
        else:
            self.pinned.difference_update(ops)
            self.in_use.difference_update(ops)
        if advance and done < len(self.future):
            self.future.pop(done)
            if done < len(self.host_budget):
                self.host_budget.pop(done)
        self.running = in_flight
        self._pump()
        return self.counters.end_step(self.arena.used)

    # -- figures ---------------------------------------------------------------------------
    @_timed
    def stats(self) -> MemoryStats:
        return self.counters.stats(self.arena.used)

    def resident_bytes(self) -> int:
        return self.arena.used

    @_timed
    def audit(self) -> MemoryAudit:
        self.host_updates.wait_all()  # (an update at home may still be settling its state)
        return audit(self.ops.values(), self.arena)

    @_timed
    def close(self) -> None:
        try:
            self.host_updates.close()
        finally:
            self._drain()
            self.copier.close()
