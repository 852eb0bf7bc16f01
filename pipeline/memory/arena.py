"""The device arena: one buffer of exactly the budget's size, and the host homes of ops.

The :class:`Arena` is one uint8 tensor of the budget's size, allocated once; regions (one per
resident op, its :class:`~pipeline.memory.state.OpLayout`'s bytes) are placed best fit and the
arena compacts when free bytes suffice but no gap does. Because every resident tensor is a view
of that one buffer, the budget is structural: it holds on CPU (where the "device" arena is just
another CPU tensor) as on CUDA, and the caching allocator cannot fragment it. The arena is never
freed, so reusing a region needs no ``record_stream``: stream order is what protects it
(:mod:`pipeline.memory.copies`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Arena", "host_buffer"]


def host_buffer(nbytes: int, kind: str, device: torch.device) -> torch.Tensor:
    """An op's host home: ``pinned`` (page-locked; only where CUDA is, else pageable),
    ``shared`` (shared memory) or ``pageable``."""
    if kind == "pinned" and device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf.share_memory_() if kind == "shared" else buf


class Arena:
    """A fixed uint8 buffer of ``capacity`` bytes with best-fit regions keyed by op id."""

    def __init__(self, capacity: int, device: torch.device, align: int) -> None:
        self.capacity = capacity
        self.align = align
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)  # allocated once, never grown
        self.regions: dict[str, tuple[int, int]] = {}  # op id -> (offset, bytes)

    @property
    def used(self) -> int:
        return sum(n for _, n in self.regions.values())

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is this arena's."""
        return t.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def gaps(self) -> list[tuple[int, int]]:
        """Free (offset, bytes) runs in address order."""
        out, cur = [], 0
        for off, n in sorted(self.regions.values()):
            if off > cur:
                out.append((cur, off - cur))
            cur = max(cur, off + n)
        if cur < self.capacity:
            out.append((cur, self.capacity - cur))
        return out

    def allocate(self, op_id: str, nbytes: int) -> int | None:
        """The offset of a new region of ``nbytes`` (best fit: the smallest gap that holds it,
        lowest first; an evicted op of the same kind leaves a hole of exactly its size, so
        the arena fragments far less than first fit), or ``None`` when no gap fits."""
        if op_id in self.regions:
            raise RuntimeError(f"op {op_id!r} already has an arena region")
        fits = [(n, off) for off, n in self.gaps() if n >= nbytes]
        if not fits:
            return None
        off = min(fits)[1]
        self.regions[op_id] = (off, nbytes)
        return off

    def free(self, op_id: str) -> None:
        del self.regions[op_id]

    def hole_if_freed(self, op_id: str) -> int:
        """Bytes of the gap that freeing ``op_id``'s region would leave: the region and the
        free runs on either side of it."""
        gaps = self.gaps()
        gap_end = {off + size: size for off, size in gaps}  # a gap that ends at an offset
        gap_start = dict(gaps)  # offset -> size of the gap starting there
        off, size = self.regions[op_id]
        return gap_end.get(off, 0) + size + gap_start.get(off + size, 0)

    def plan_compaction(self, fixed: Iterable[str], need: int | None = None) -> dict[str, int]:
        """New offsets for the regions not in ``fixed``, slid down in address order around the
        fixed ones (each moves to a lower or the same offset); only those that move. With
        ``need``, it stops as soon as a gap of ``need`` bytes has opened (fewer bytes moved)."""
        fixed = set(fixed) & set(self.regions)  # (ops without bytes have no region)
        fixed_spans = sorted(self.regions[o] for o in fixed)
        moves, cur = {}, 0
        for op_id, (off, n) in sorted(self.regions.items(), key=lambda kv: kv[1][0]):
            if need is not None and off - cur >= need:
                break  # the gap below this region already holds it
            if op_id in fixed:
                cur = max(cur, off + n)
                continue
            target = cur
            for f_off, f_n in fixed_spans:  # skip past fixed regions it would overlap
                if target < f_off + f_n and f_off < target + n:
                    target = f_off + f_n
            target = min(target, off)
            if target != off:
                moves[op_id] = target
            cur = max(cur, target + n)
        return moves

    def move(self, op_id: str, new_off: int) -> None:
        """Move a region's bytes down to ``new_off`` (overlap allowed; a forward copy in chunks
        no longer than the distance moved, so no chunk reads bytes already overwritten)."""
        off, n = self.regions[op_id]
        if new_off > off:
            raise ValueError("regions only move down")
        step = off - new_off
        if step == 0:
            return
        buf = self.buffer
        if n <= step or n // step <= 8:
            for i in range(0, n, step):
                m = min(step, n - i)
                buf[new_off + i : new_off + i + m].copy_(buf[off + i : off + i + m])
        else:  # many small chunks: one temporary copy is cheaper
            buf[new_off : new_off + n].copy_(buf[off : off + n].clone())
        self.regions[op_id] = (new_off, n)
