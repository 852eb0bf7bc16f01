"""What a tensor-managed run pays to give its ops pinned host homes (CUDA only).

The ninth GPU session's profile (bench/RESULTS.md, 2026-11-28) found 4.3 s in 194 calls of
``torch.empty(nbytes, pin_memory=True)`` (``pipeline.memory.arena.host_buffer``) for 2.15 GB of op
state. This times the ways to get the same bytes page-locked: one pinned tensor per op (today),
one pinned slab for all of them, and ``cudaHostRegister`` on ordinary memory (no rounding by torch's
caching host allocator), each into a fresh process's allocator, and reports the host allocator's
statistics (what it reserved for what was asked).

    python bench/pinned_alloc.py [--ops 194] [--mib 11]

One JSON line per way.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(way: str, ops: int, nbytes: int) -> dict:
    import torch

    torch.cuda.init()
    torch.empty(1, pin_memory=True)  # the allocator's own start
    t0 = time.perf_counter()
    if way == "per_op":
        bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(ops)]
    elif way == "slab":
        bufs = [torch.empty(nbytes * ops, dtype=torch.uint8, pin_memory=True)]
    elif way == "register":
        buf = torch.empty(nbytes * ops, dtype=torch.uint8)
        buf[::4096] = 0  # touched, as a home's zero fill would
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        assert int(rc) == 0, rc
        bufs = [buf]
    else:
        raise SystemExit(f"way: expected per_op, slab or register, found {way!r}")
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in bufs:
        b.zero_()
    fill_s = time.perf_counter() - t0
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(min(ops, 32)):
        src = bufs[i] if len(bufs) > 1 else bufs[0][i * nbytes:(i + 1) * nbytes]
        dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    h2d = min(ops, 32) * nbytes / (time.perf_counter() - t0)
    stats = {k: v for k, v in torch.cuda.host_memory_stats().items()
             if k in ("allocated_bytes.current", "reserved_bytes.current", "num_host_alloc", "host_alloc_time.total")} \
        if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"way": way, "ops": ops, "bytes": ops * nbytes, "alloc_s": round(alloc_s, 3), "zero_s": round(fill_s, 3),
            "h2d_GBps": round(h2d / 1e9, 2), "host_stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=194)
    ap.add_argument("--mib", type=float, default=11.0)
    ap.add_argument("--ways", nargs="+", default=["per_op", "slab", "register", "per_op"])
    ap.add_argument("--way", help=argparse.SUPPRESS)
    a = ap.parse_args()
    nbytes = int(a.mib * 2**20)
    if a.way:
        print(json.dumps(one(a.way, a.ops, nbytes)), flush=True)
        return
    for way in a.ways:  # each in a fresh process: a fresh caching host allocator
        subprocess.run([sys.executable, __file__, "--way", way, "--ops", str(a.ops), "--mib", str(a.mib)], check=False)


if __name__ == "__main__":
    main()
