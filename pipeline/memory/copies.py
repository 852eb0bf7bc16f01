"""The copy engines that move an op's bytes between its host home and its arena region.

Copies run off the critical path on a :class:`ThreadCopier` (CPU: one worker thread, so copies
run in submission order like a stream) or a :class:`CudaCopier` (a side stream per direction,
host-to-device fetches beside device-to-host write-backs, as a full-duplex link carries them;
each first waits for the compute stream's queued work, so a region is overwritten only after the
kernels that read it ran; an event recorded after each copy is what the compute stream waits on
before using the op). A copy on one stream that touches bytes an earlier copy on the other stream
reads or writes (a fetch into the region a write-back is still reading) waits for that copy's
event (:func:`conflicts`). On a CPU the default is the :class:`InlineCopier` (``memory.cpu_copies``).
"""
from __future__ import annotations

import concurrent.futures
from typing import Protocol

import torch

__all__ = ["Handle", "Copier", "ThreadCopier", "InlineCopier", "CudaCopier", "make_copier", "COPY_TIMEOUT_S",
           "Span", "conflicts"]

COPY_TIMEOUT_S = 300.0  # a copy that takes longer than this is a hang, not a slow link


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


Span = tuple[str, int, int]  # (memory: a device's name, or "host"), first byte, one past the last


def span_of(t: torch.Tensor) -> Span:
    """Where a tensor's bytes lie (pinned host memory and each device are separate spaces)."""
    start = t.data_ptr()
    return ("host" if t.device.type == "cpu" else str(t.device), start, start + t.numel() * t.element_size())


def _overlap(a: Span, b: Span) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _direction(dst: torch.Tensor, src: torch.Tensor) -> str:
    return "d2h" if dst.device.type == "cpu" else "h2d"


def conflicts(dst: Span, src: Span, stream: str, earlier: list[tuple[str, Span, Span]]) -> list[int]:
    """The earlier copies, ``(stream, dst, src)`` each, that a copy from ``src`` into ``dst`` on
    ``stream`` must wait for: those on another stream that write what it reads or writes, or read
    what it writes (copies on one stream run in order)."""
    return [i for i, (st, d, s) in enumerate(earlier)
            if st != stream and (_overlap(dst, d) or _overlap(dst, s) or _overlap(src, d))]


class CudaCopier:
    """Copies on two side streams, fetches (host to device) beside write-backs (device to host).
    Each copy first waits for everything queued on the compute stream (so a region is overwritten
    only after the kernels that read it ran) and for the copies in flight on the other stream
    whose bytes it touches (:func:`conflicts`); each records an event that the compute stream
    waits on before the op is used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {"h2d": torch.cuda.Stream(device=device), "d2h": torch.cuda.Stream(device=device)}
        self._recent: list[tuple[str, Span, Span, torch.cuda.Event]] = []  # copies maybe still in flight

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Handle:
        name = _direction(dst, src)
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        spans = (span_of(dst), span_of(src))
        self._recent = [r for r in self._recent if not r[3].query()]
        for i in conflicts(*spans, name, [(n, d, s) for n, d, s, _ in self._recent]):
            stream.wait_event(self._recent[i][3])
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._recent.append((name, *spans, event))
        # dst or src may be a host tensor whose memory the caller keeps (an op's host home,
        # freed only after synchronize()); device-side both are views of the arena, which is
        # never freed, so no record_stream is needed for the caching allocator.
        return _EventHandle(event, self.device)

    def flush(self) -> None:
        """Nothing to do: each copy is queued on its side stream when issued."""

    def close(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


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
