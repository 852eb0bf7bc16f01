"""The tensor manager's copy engine on a GPU: fetches and write-backs on one stream or a stream each.

``CudaCopier`` (pipeline/memory/copies.py) issues host-to-device fetches and device-to-host
write-backs on a stream per direction; before fb3ab5a both went on one stream. This measures,
on the job's GPU and in one run, the bytes per second of:

* ``h2d``: fetches alone (pinned host home -> arena region), and ``d2h``: write-backs alone;
* ``both, one stream``: the same fetches and write-backs interleaved on one side stream (the
  copier before);
* ``both, CudaCopier``: the same copies through today's copier (a stream per direction; a fetch
  waits only for a write-back that touches its bytes, and here none does);
* ``link limit``: ``h2d`` + ``d2h`` alone, what a full-duplex link could carry at once.

Each figure is the median of ``--repeats`` timed rounds after a warm-up round; every round moves
``--ops`` regions of ``--mb`` MiB each way. One JSON line per figure and a summary line with the
ratio of today's copier over one stream. Needs CUDA (exits with a message otherwise).

    python bench/copy_streams.py [--ops 16] [--mb 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.memory.copies import CudaCopier  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which queues copies) until the device is idle again."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=16, help="regions moved each way per round")
    ap.add_argument("--mb", type=int, default=64, help="MiB per region")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/copy_streams.py: needs CUDA (no GPU here); the CPU copier has no streams to compare")
    dev = torch.device("cuda")
    n = args.mb * 2**20
    arena = torch.empty(2 * args.ops * n, dtype=torch.uint8, device=dev)
    homes_in = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in range(args.ops)]  # fetched from
    homes_out = [torch.empty(n, dtype=torch.uint8).pin_memory() for _ in range(args.ops)]  # written back to
    fetch_dst = [arena[i * n:(i + 1) * n] for i in range(args.ops)]
    back_src = [arena[(args.ops + i) * n:(args.ops + i + 1) * n] for i in range(args.ops)]
    side = torch.cuda.Stream(device=dev)

    def one_stream(fetch: bool, back: bool):
        def run():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i in range(args.ops):
                    if back:
                        homes_out[i].copy_(back_src[i], non_blocking=True)
                    if fetch:
                        fetch_dst[i].copy_(homes_in[i], non_blocking=True)
            torch.cuda.current_stream(dev).wait_stream(side)
        return run

    copier = CudaCopier(dev)

    def through_copier():
        handles = []
        for i in range(args.ops):
            handles.append(copier.copy(homes_out[i], back_src[i]))
            handles.append(copier.copy(fetch_dst[i], homes_in[i]))
        for h in handles:
            h.wait()

    moved = args.ops * n
    rows = {}
    for name, fn, nbytes in (("h2d", one_stream(True, False), moved), ("d2h", one_stream(False, True), moved),
                             ("both, one stream", one_stream(True, True), 2 * moved),
                             ("both, CudaCopier", through_copier, 2 * moved)):
        s = timed(fn, args.repeats)
        rows[name] = nbytes / s
        print(json.dumps({"bench": "copy_streams", "what": name, "GBps": nbytes / s / 1e9, "seconds": s,
                          "bytes": nbytes, "device": torch.cuda.get_device_name(dev)}), flush=True)
    limit = rows["h2d"] + rows["d2h"]
    print(json.dumps({"bench": "copy_streams_summary", "device": torch.cuda.get_device_name(dev),
                      "copier_over_one_stream": rows["both, CudaCopier"] / rows["both, one stream"],
                      "copier_over_link_limit": rows["both, CudaCopier"] / limit,
                      "link_limit_GBps": limit / 1e9, "ops": args.ops, "MiB_each": args.mb,
                      "repeats": args.repeats}), flush=True)


if __name__ == "__main__":
    main()
