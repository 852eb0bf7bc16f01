"""The device arena, an op's byte layout, and the copy engines that move ops between tiers.

An op's weights, buffers and optimizer state are laid out as one run of aligned byte slots
(:class:`OpLayout`): the same layout in its host home (one uint8 tensor per op) and in its
region of the device arena, so fetching an op is one contiguous copy and so is writing it
back. The :class:`Arena` is one uint8 tensor of exactly the budget's size, allocated once;
regions are placed best fit and the arena compacts when free bytes suffice but no gap does.
Because every resident tensor is a view of that one buffer, the budget is structural: it
holds on CPU (where the "device" arena is just another CPU tensor) as on CUDA, and the caching
allocator cannot fragment it.

Copies run off the critical path on a :class:`ThreadCopier` (CPU: one worker thread, so copies
run in submission order like a stream) or a :class:`CudaCopier` (a side stream that first
waits for the compute stream's queued work; an event recorded after each copy is what the
compute stream waits on before using the op). The arena is never freed, so reusing a region
needs no ``record_stream``: stream order is what protects it (a write-back and the fetch that
reuses its region are issued on the same stream, after the compute that last read it).
"""
from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Slot", "OpLayout", "Arena", "Handle", "Copier", "ThreadCopier", "InlineCopier", "CudaCopier", "make_copier",
           "host_buffer", "alignment_for", "COPY_TIMEOUT_S"]

COPY_TIMEOUT_S = 300.0  # a copy that takes longer than this is a hang, not a slow link


def alignment_for(device: torch.device) -> int:
    """Byte alignment of every slot: the CPU allocator's 64 bytes (so kernels see the same
    pointer alignment as for ordinary tensors) or the CUDA caching allocator's 512."""
    return 512 if device.type == "cuda" else 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


_TEMPLATES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


@dataclass(frozen=True)
class Slot:
    """One tensor of an op: ``kind`` is ``param``, ``buffer`` or ``optim``; ``index`` the
    parameter's position (``optim``) and ``name`` its name or the optimizer state key."""

    kind: str
    name: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    stride: tuple[int, ...] = ()

    def view(self, buf: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This slot's tensor over ``buf``'s bytes (a uint8 tensor) from byte ``base``.

        It aliases the memory but is not an autograd view of ``buf``: views share their base's
        version counter, so an in-place update of one op's batch-norm statistics would look
        like a change to every weight saved for the backward."""
        start = buf.storage_offset() + base + self.offset
        key = (self.dtype, buf.device)
        tmpl = _TEMPLATES.get(key)
        if tmpl is None:
            tmpl = _TEMPLATES[key] = torch.empty(0, dtype=self.dtype, device=buf.device)
        # tmpl.new(): a fresh empty tensor (own version counter), 3x cheaper than torch.empty
        return tmpl.new().set_(buf.untyped_storage(), start // self.dtype.itemsize, self.shape, self.stride)


@dataclass(frozen=True)
class OpLayout:
    """Where each of an op's tensors sits in its bytes (host home and arena region alike)."""

    slots: tuple[Slot, ...]
    nbytes: int

    @staticmethod
    def build(entries: Iterable[tuple[str, str, int, torch.dtype, tuple[int, ...]]], align: int) -> OpLayout:
        slots, off = [], 0
        for kind, name, index, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
            slots.append(Slot(kind, name, index, dtype, tuple(shape), off, n, stride))
            off = _align(off + max(n, 1), align)
        return OpLayout(tuple(slots), max(off, align))


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


class Handle(Protocol):
    def wait(self) -> None:
        """Before the copied bytes are used: block (CPU) or order the compute stream (CUDA)."""

    def done(self) -> bool: ...

    def synchronize(self) -> None:
        """Block the host until the copy is complete (before host code reads or frees it)."""


class Copier(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle: ...

    def flush(self) -> None:
        """Start the copies issued so far (they may wait until then)."""

    def close(self) -> None: ...


def _run_copies(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    # One call for the whole batch: it releases the GIL once. A Python loop of copy_ calls
    # takes the GIL back between copies, and every hand-back can stall the compute thread
    # for up to the interpreter's switch interval (5 ms).
    torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])


class _Batch:
    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.future: concurrent.futures.Future | None = None


class _BatchHandle:
    def __init__(self, copier: ThreadCopier, batch: _Batch) -> None:
        self._copier, self._batch = copier, batch

    def wait(self) -> None:
        if self._batch.future is None:
            self._copier.flush()
        try:
            self._batch.future.result(timeout=COPY_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"tensor manager: a copy did not finish within {COPY_TIMEOUT_S} s") from None

    synchronize = wait

    def done(self) -> bool:
        return self._batch.future is not None and self._batch.future.done()


class ThreadCopier:
    """Copies on one background thread, in submission order (the CPU stand-in for a stream).

    Copies are handed over in batches (``flush``, or waiting on any of them): waking the
    thread once per copy cost ~1 ms of the caller's time each on a busy 2-core machine."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor-copy")
        self._batch: _Batch | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle:
        if self._batch is None:
            self._batch = _Batch()
        self._batch.copies.append((dst, src))
        return _BatchHandle(self, self._batch)

    def flush(self) -> None:
        """Start the copies issued since the last flush (in order, after the earlier ones)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.future = self._pool.submit(_run_copies, batch.copies)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


class _EventHandle:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event, self._device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def done(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaCopier:
    """Copies on a side stream that first waits for everything queued on the compute stream
    (so a region is overwritten only after the kernels that read it ran); each copy records
    an event that the compute stream waits on before the op is used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # dst or src may be a host tensor whose memory the caller keeps (an op's host home,
        # freed only after synchronize()); device-side both are views of the arena, which is
        # never freed, so no record_stream is needed for the caching allocator.
        return _EventHandle(event, self.device)

    def flush(self) -> None:
        """Nothing to do: each copy is queued on the side stream when issued."""

    def close(self) -> None:
        self.stream.synchronize()


class _Done:
    def wait(self) -> None: ...

    synchronize = wait

    def done(self) -> bool:
        return True


class InlineCopier:
    """Copies on the calling thread, at once (CPU only: ``memory.cpu_copies=inline``).

    On a CPU the "device" is host memory, so a background thread cannot overlap a copy with
    anything but the compute it competes with for cores, memory bandwidth and the GIL; on the
    2-core bench machine the thread cost more than it hid (bench/RESULTS.md)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle:
        dst.copy_(src)
        return _Done()

    def flush(self) -> None: ...

    def close(self) -> None: ...


def make_copier(device: torch.device, cpu_copies: str = "inline") -> Copier:
    if device.type == "cuda":
        return CudaCopier(device)
    return InlineCopier() if cpu_copies == "inline" else ThreadCopier()
