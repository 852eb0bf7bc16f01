"""glibc's malloc tuned for training: freed host memory stays in the process.

A training step frees and allocates the same large tensors every step (activations, gradients,
temporaries; on the CPU every one of them is host memory). With glibc's defaults a block freed
at the top of the heap beyond the trim threshold goes back to the kernel, and a block above the
mmap threshold is mapped and unmapped on its own (glibc raises both thresholds as it sees large
blocks freed, up to 32 MiB): the next step's allocations fault those pages in again, and the
kernel zeroes each page, on the core that computes. :func:`keep_freed_memory` sets three of
malloc's parameters (``mallopt``): the mmap threshold fixed at 32 MiB, its largest (smaller
blocks come from the heap from the first step, not once the dynamic threshold has grown), the
trim threshold at 1 GiB (freed memory at the heap's top stays, up to that), and a 64 MiB top pad
(the heap grows in larger steps). An allocator does not change what the kernels compute: the same
bits. The price: the process's resident size stays near its peak instead of shrinking between
steps (the peak itself did not move). Measured on this project's 2-core CPU machine
(bench/RESULTS.md, 2026-11-28): the transformer w256's runs fault 2-3x fewer pages; its
data-parallel run under torchrun 2 trained 13.40 s against 14.41 s (1.56x one process against
1.43x in the same table); one process and the default space within the machine's noise.

PyTorch's CPU performance guide recommends jemalloc or tcmalloc (``LD_PRELOAD``) for the same
reason; this needs neither, nor a launcher change. Only glibc has ``mallopt``: elsewhere (musl,
macOS, Windows) nothing changes and :func:`keep_freed_memory` says so. The app calls it at
start unless ``keep_host_memory=false``.
"""
from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD"]

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): above it, blocks are mapped alone
TRIM_THRESHOLD = 1 << 30   # freed memory kept at the heap's top
TOP_PAD = 64 << 20         # extra the heap grows by


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module doc). True if every parameter
    took; False where the C library has no ``mallopt`` (not glibc) or refused one. Idempotent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(param, value) for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                       (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                                       (_M_TOP_PAD, TOP_PAD))]
    return all(t == 1 for t in took)
