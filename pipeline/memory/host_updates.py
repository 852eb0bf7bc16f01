"""Host-side optimizer updates off the training thread.

An op whose optimizer state stays in its host home (``memory.optimizer`` host, or hybrid when
the next subnet does not reuse it) is updated by the host. Run on the training thread, that
update holds the device idle: measured on an H100 (bench/RESULTS.md, 2026-11-27), one process on
NASPipe's space cut to 8 layers at width 1024 stepped its subnets' AdamW at home in ~290 ms a
step against 82 ms of device compute, so ``hybrid`` ran at 0.22x of all-resident. :class:`HostUpdates`
runs each op's update on a pool of worker threads instead (torch's kernels release the GIL; each
op's update is its own, so ``threads`` ops step at once), while the training thread goes on with
the next subnet. An op with an update in flight is not touched until it is over: its next fetch,
export or removal waits for it (:meth:`wait`), and the prefetch passes it by (:meth:`pending`).
Each op's arithmetic is the same on whichever thread runs it, so the bits do not change.

``threads=0`` runs every update at once on the calling thread (the behaviour before).
:meth:`HostUpdates.throughput` measures what the pool steps a second (``memory.host_update_rate:
auto``).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["HostUpdates", "auto_threads"]


def auto_threads(cpus: int | None = None, local_processes: int | None = None) -> int:
    """Worker threads for ``memory.host_update_threads: null``: the cores this process may use
    (``cpus``: ``os.sched_getaffinity``), shared with the other processes of the job on this
    machine (``local_processes``: torchrun's ``LOCAL_WORLD_SIZE``), less one for the training
    thread; at least 1, at most 8."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, cpus // max(1, local_processes) - 1))


class HostUpdates:
    """Per op, the host update in flight (see the module docstring)."""

    def __init__(self, threads: int) -> None:
        if threads < 0:
            raise ValueError(f"memory.host_update_threads: expected an integer >= 0 or null, found {threads}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[str, Future] = {}

    def submit(self, op_id: str, update: Callable[[], None]) -> None:
        """Run ``update`` (the op's optimizer step at home) in the background; the op's earlier
        update, if any, is over first."""
        self.wait(op_id)
        if self.threads == 0:
            update()
            return
        self._running[op_id] = self._workers().submit(update)

    def _workers(self) -> ThreadPoolExecutor:
        """The worker threads (made at their first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pipenas-host-update")
        return self._pool

    def throughput(self, make_job: Callable[[int], Callable[[], int]], rounds: int = 3) -> float:
        """Parameters a second the host steps on these threads: one job per thread at once (none: the
        calling thread's alone), each stepping the parameters ``make_job(k)`` made for it and
        returning how many; the best of ``rounds`` rounds after a warm-up round (whose first
        step makes the optimizer's state)."""
        jobs = [make_job(k) for k in range(max(1, self.threads))]
        best = math.inf
        n = 0
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            n = (sum(f.result() for f in [self._workers().submit(j) for j in jobs]) if self.threads
                 else sum(j() for j in jobs))
            if r:
                best = min(best, time.perf_counter() - t0)
        return n / max(best, 1e-9)

    def pending(self, op_id: str) -> bool:
        """Whether the op's update is still running (a failed one counts as over: :meth:`wait` raises it)."""
        f = self._running.get(op_id)
        return f is not None and not f.done()

    def wait(self, op_id: str) -> bool:
        """Wait for the op's update, if one is in flight (re-raising its error); whether it had to."""
        f = self._running.pop(op_id, None)
        if f is None:
            return False
        waited = not f.done()
        try:
            f.result()
        except Exception as e:
            raise RuntimeError(f"memory: the host's optimizer update of op {op_id!r} failed: "
                               f"{type(e).__name__}: {e}") from e
        return waited

    def wait_all(self) -> None:
        """Wait for every update in flight (the first error is raised once all are over)."""
        error = None
        for op_id in list(self._running):
            try:
                self.wait(op_id)
            except BaseException as e:  # noqa: BLE001 - the others still finish first
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
