"""The tensor manager's figures: its counters, per step and in total, and the audit of the device tier."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from .arena import Arena
from .placement import RESIDENT, OpPlacement
from .state import flat_tensors

__all__ = ["MemoryStats", "MemoryAudit", "Counters", "audit"]

_GAUGES = ("budget_bytes", "resident_bytes", "resident_bytes_peak")  # levels, not counts


@dataclass(frozen=True)
class MemoryStats:
    """Counters of the tensor manager (totals, or one step's deltas from ``release_step``).

    ``resident_bytes_peak``: most bytes of arena regions (resident ops and fetches in flight)
    at any moment. ``hits``: uses whose op was resident before (fetched ahead and complete, or
    kept from an earlier use); ``late``: prefetched but still in flight when needed;
    ``misses``: fetched on demand. ``stall_s``: time ``ensure`` waited; ``busy_s``: host time in
    the manager's calls (bookkeeping, issuing copies, and the stalls). ``written_back_bytes``:
    device-to-host bytes (write-backs, and gradients with the host-updated optimizer).
    ``host_updates``: op updates that ran on the host (``memory.optimizer`` host or hybrid)."""

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
    host_updates: int = 0
    arrived: int = 0  # ops that came from another stage straight into the arena
    stall_s: float = 0.0
    busy_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.late + self.misses
        return self.hits / uses if uses else 1.0

    def since(self, before: MemoryStats, peak: int) -> MemoryStats:
        """The counters accumulated since ``before``, with ``peak`` as the peak."""
        kw = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self) if f.name not in _GAUGES}
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


class Counters:
    """A store's running totals (the counts of :class:`MemoryStats`), its peak resident bytes
    overall and since the last step, and the step deltas ``release_step`` returns."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.totals: dict[str, Any] = {f.name: 0 for f in fields(MemoryStats) if f.name not in _GAUGES}
        self.totals["stall_s"] = self.totals["busy_s"] = 0.0
        self.peak = 0
        self.step_peak = 0
        self._at_release = self.stats(0)

    def add(self, **counts: float) -> None:
        for k, v in counts.items():
            self.totals[k] += v

    def resident(self, used: int) -> None:
        """The arena holds ``used`` bytes now (after a region was placed)."""
        self.peak = max(self.peak, used)
        self.step_peak = max(self.step_peak, used)

    def stats(self, used: int) -> MemoryStats:
        return MemoryStats(self.budget, used, self.peak, **self.totals)

    def end_step(self, used: int) -> MemoryStats:
        """The counters since the last call (the step's), the step's peak with them."""
        now = self.stats(used)
        step = now.since(self._at_release, self.step_peak)
        self._at_release = now
        self.step_peak = used
        return step


def audit(placements: Iterable[OpPlacement], arena: Arena) -> MemoryAudit:
    """Walk every op's module and optimizer state: which tensors are views of the arena (and of
    their own op's region), which of their host home, and which of neither, or of the arena
    when they should be home (stray: the optimizer state of an op updated on the host)."""
    arena_bytes, stray, resident = 0, [], 0
    base = arena.buffer.data_ptr()
    for rec in placements:
        resident += rec.state == RESIDENT
        home = rec.host.untyped_storage().data_ptr()
        for name, t in flat_tensors(rec.module, rec.params, rec.opt, scalars=False):
            if arena.holds(t):
                if rec.optim_on_host and name.startswith("optim/"):
                    stray.append(f"{rec.op_id}.{name} (in the arena, updated on the host)")
                off, n = arena.regions.get(rec.op_id, (-1, 0))
                start = t.data_ptr() - base
                if not (off <= start and start + t.nbytes <= off + n):
                    stray.append(f"{rec.op_id}.{name} (in the arena outside its region)")
                arena_bytes += t.nbytes
            elif t.untyped_storage().data_ptr() != home and t.nbytes:
                stray.append(f"{rec.op_id}.{name}")
    return MemoryAudit(arena.capacity, arena.used, arena_bytes, resident, tuple(stray))
