"""The device working set of a virtual store: which ops sit in the arena, and the copies that move them.

:class:`WorkingSet` holds every owned op's :class:`~pipeline.memory.placement.OpPlacement` (in
its host home, being fetched, or resident in the :class:`~pipeline.memory.arena.Arena`), the
known future (the op sets of the coming steps, the one about to run first), and the copies in
flight. It places a fetch in the arena, evicting what its :mod:`~pipeline.plan.policy` says
(the same objects the offline planner asks) and compacting the arena when free bytes suffice but
no gap does; it fetches the coming steps' ops ahead while the budget and ``max_in_flight``
allow. An evicted op is copied back only when dirty: it took an optimizer step on the device,
or it has buffers (batch norm) and was used. With the hybrid optimizer placement each fetch also
chooses whether the op's optimizer state comes along (:meth:`WorkingSet._keeps_state`).
:class:`~pipeline.memory.virtual.VirtualStore` is the store interface on top of it.
"""
from __future__ import annotations

import math
from collections.abc import Collection

import torch

from ..plan.hybrid import REUSE_NEXT, op_runs
from .arena import Arena
from .copies import Handle, make_copier
from .errors import fragmented_error
from .host_updates import HostUpdates, auto_threads
from .placement import FETCHING, HOST, RESIDENT, OpPlacement
from ..plan.policy import Candidate, policy_named
from .settings import MemorySettings
from .state import alignment_for
from .stats import Counters

__all__ = ["WorkingSet"]


class WorkingSet:
    """The arena's residents, the eviction and prefetch decisions, and the copies in flight."""

    def __init__(self, settings: MemorySettings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.policy = policy_named(settings.policy)
        self.hybrid = settings.optimizer == "hybrid"
        self.align = alignment_for(device)
        self.arena = Arena(settings.budget_for(device), device, self.align)
        self.copier = make_copier(device, settings.cpu_copies)
        threads = settings.host_update_threads
        self.host_updates = HostUpdates(auto_threads() if threads is None else threads)  # updates at home in flight
        self.counters = Counters(self.arena.capacity)
        self.ops: dict[str, OpPlacement] = {}
        self.future: list[frozenset[str]] = []
        # hybrid: per future entry, the parameters the host may still step for it (None: no limit;
        # memory.host_update_rate times the entry's estimated compute here)
        self.host_budget: list[float | None] = []
        self.running = 0  # the future's first entries that are subnets in flight (their ops pinned)
        self.pinned: set[str] = set()  # needed by the current step
        self.in_use: set[str] = set()  # handed out this step: in an autograd graph, must not move
        self.ahead: set[str] = set()  # fetched ahead and not used yet
        self.in_flight: list[tuple[OpPlacement, Handle]] = []
        self._blocked = False  # prefetch stopped at the in-flight limit: pump again later

    # -- the policy's questions ---------------------------------------------------------------
    def _next_use(self, op_id: str) -> float:
        for i, s in enumerate(self.future):
            if op_id in s:
                return i
        return math.inf

    def _candidates(self, keep: Collection[str]) -> list[Candidate]:
        """The ops an eviction may take, least recently used first (never a pinned one, one in
        ``keep``, or one without bytes)."""
        recs = sorted((r for r in self.ops.values() if r.state == RESIDENT and r.nbytes
                       and r.op_id not in self.pinned and r.op_id not in keep), key=lambda r: r.last_use)
        return [Candidate(r.op_id, self._next_use(r.op_id), r.op_id in self.ahead) for r in recs]

    def _victim(self, limit: float | None, keep: Collection[str]) -> OpPlacement | None:
        """The op to evict for a fetch needed at future index ``limit`` (``None``: now, on demand)."""
        v = self.policy.victim(self._candidates(keep), limit)
        return None if v is None else self.ops[v.op_id]

    def _hole_victim(self, n: int, limit: float | None, keep: Collection[str]) -> OpPlacement | None:
        """Among the ops the policy ranks first together, the least recently used one whose
        region, with the free bytes around it, holds ``n`` bytes: evicting it costs no more than
        the rule's own choice, and it spares moving other ops' bytes around (compaction)."""
        for c in self.policy.alike(self._candidates(keep), limit):
            if self.arena.hole_if_freed(c.op_id) >= n:
                return self.ops[c.op_id]
        return None

    # -- placing an op ------------------------------------------------------------------------
    def _keeps_state(self, op_id: str, idx: int) -> bool:
        """Hybrid placement: whether the op's use at future index ``idx`` is updated on the
        device (its state comes along and stays while the next subnets reuse it), by the rule of
        :mod:`pipeline.plan.hybrid` over the future the engine announced."""
        rest = self.future[idx:]
        steps = [0] + [i for i in range(1, len(rest)) if op_id in rest[i]]
        layout = self.ops[op_id].layout
        w = layout.weights_nbytes
        s = layout.nbytes - w
        return op_runs(steps, w, s, REUSE_NEXT.host(op_id, s), REUSE_NEXT)[1][0]

    def _place(self, rec: OpPlacement, idx: int, limit: float | None, keep: Collection[str] = (),
               step_ops: Collection[str] = ()) -> int | None:
        """Place ``rec`` for its use at future index ``idx`` (:meth:`_make_room`); with the hybrid
        placement, with its optimizer state when the rule says so and room allows (the ops of
        its step, ``step_ops``, must still fit together), else without. An op still updated at
        home is placed once that update is over (its placement and the copy of its home follow)."""
        self.host_updates.wait(rec.op_id)
        if self.hybrid and rec.state == HOST:
            extra = rec.layout.nbytes - rec.layout.weights_nbytes
            together = sum(self.ops[o].nbytes for o in step_ops if o in self.ops and o != rec.op_id) + rec.nbytes
            budget = self.host_budget[idx] if idx < len(self.host_budget) else None
            params = 0 if budget is None else sum(p.numel() for p in rec.params)
            over = budget is not None and budget < params  # the host cannot step it in time
            if together + extra <= self.arena.capacity and (over or self._keeps_state(rec.op_id, idx)):
                rec.set_host_update(False)
                off = self._make_room(rec, limit, keep, soft=True)
                if off is not None:
                    return off
            rec.set_host_update(True)
            off = self._make_room(rec, limit, keep)
            if off is not None and budget is not None:
                self.host_budget[idx] = budget - params
            return off
        return self._make_room(rec, limit, keep)

    def _make_room(self, rec: OpPlacement, limit: float | None, keep: Collection[str] = (),
                   soft: bool = False) -> int | None:
        """Place ``rec`` in the arena, evicting as the policy says; ``None`` when a prefetch
        (``limit`` set) would have to evict something needed sooner, or (``soft``) when nothing
        more can be evicted."""
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
                if limit is not None or soft:
                    return None
                raise fragmented_error(rec.op_id, n, self.arena.capacity - self.arena.used, len(self.in_use),
                                       sum(self.ops[o].nbytes for o in self.pinned), self.arena.capacity)
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

    # -- copies -------------------------------------------------------------------------------
    def _start_fetch(self, rec: OpPlacement, off: int) -> None:
        rec.offset = off
        rec.state = FETCHING
        rec.fetch = self.copier.copy(self.arena.buffer[off : off + rec.nbytes], rec.host[: rec.nbytes])
        self.in_flight.append((rec, rec.fetch))
        self.counters.add(fetched_bytes=rec.nbytes, fetches=1)
        self.counters.resident(self.arena.used)

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
        self.counters.add(written_back_bytes=rec.nbytes, write_backs=1)
        return h

    def _go_home(self, rec: OpPlacement) -> None:
        """Point the op at its host home (read only after ``host_pending`` is synchronized) and
        free its region."""
        rec.point(rec.host, 0)
        self.arena.free(rec.op_id)
        rec.state, rec.offset = HOST, -1
        if self.hybrid:  # at home the op needs the least room: its next use decides again
            rec.set_host_update(True)
        self.ahead.discard(rec.op_id)
        self.counters.add(evictions=1)

    def _evict(self, rec: OpPlacement) -> None:
        self._complete(rec)
        if rec.dirty:
            self._write_back(rec)  # in stream order before any fetch that reuses the region
        self._go_home(rec)

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
        the in-flight limit allow: the subnets in flight and ``prefetch_depth + 1`` after them."""
        keep = []
        for rec, h in self.in_flight:
            if h.done():
                if rec.host_pending is h:
                    rec.host_pending = None
            else:
                keep.append((rec, h))
        self.in_flight = keep
        self._blocked = False
        if not self.policy.prefetches:
            return
        horizon = self.future[: self.running + self.settings.prefetch_depth + 1]  # past those in flight
        for idx, ops in enumerate(horizon):
            for op_id in sorted(ops):
                rec = self.ops.get(op_id)
                if rec is None or rec.state != HOST or rec.nbytes == 0 or self.host_updates.pending(op_id):
                    continue  # (an op still updated at home is fetched once that is over)
                if len(self.in_flight) >= self.settings.max_in_flight:
                    self._blocked = True
                    return
                off = self._place(rec, idx, limit=idx, keep=ops if self.policy.spares_fetched_step else (),
                                  step_ops=ops)
                if off is None:
                    return  # the budget is full of ops needed no later than this one
                self._start_fetch(rec, off)
                self.ahead.add(op_id)
