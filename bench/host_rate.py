"""What the host's optimizer steps a second: the rate ``memory.host_update_rate: auto`` measures,
per optimizer and thread count, with PortableAdamW's square root taken both ways in the same run.

    flock -x /tmp/bench.lock .venv/bin/python bench/host_rate.py [--threads 0 1] [--numel 2097152] [--rounds 5]

Rows (one JSON line each): ``sgd`` (momentum, ``foreach=False``), ``adamw`` (torch's fused CPU
kernel: a CPU run's updates), ``portable`` (PortableAdamW, a CUDA run's host updates, whose
square root is numpy's correctly rounded float32 one) and ``portable_float64_sqrt`` (the same
with the square root in float64 rounded to float32, as before 2026-11-28: the same bits, checked
here). Each: ``numel`` parameters per thread in four tensors, one job per thread at once (0: the
calling thread), the best of ``--rounds`` after a warm-up (:meth:`HostUpdates.throughput`). The
last line: the portable rows' ratio at each thread count and whether both ways gave the same bits.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.memory import optim  # noqa: E402
from pipeline.memory.host_updates import HostUpdates  # noqa: E402
from pipeline.memory.optim import OptimConfig, synthetic_update  # noqa: E402

CONFIGS = {
    "sgd": OptimConfig("sgd", lr=0.1, momentum=0.9, nesterov=True),
    "adamw": OptimConfig("adamw", lr=1e-3, weight_decay=0.01),
    "portable": OptimConfig("adamw", lr=1e-3, weight_decay=0.01, portable=True),
    "portable_float64_sqrt": OptimConfig("adamw", lr=1e-3, weight_decay=0.01, portable=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--numel", type=int, default=1 << 21)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rates: dict[tuple[str, int], float] = {}
    for threads in args.threads:
        for name, config in CONFIGS.items():
            old_sqrt = name == "portable_float64_sqrt"
            with mock.patch.object(optim, "_numpy_sqrt_ok", lambda: False) if old_sqrt else contextlib.nullcontext():
                pool = HostUpdates(threads)
                rate = pool.throughput(lambda k, c=config: synthetic_update(c, k, args.numel), rounds=args.rounds)
                pool.close()
            rates[(name, threads)] = rate
            print(json.dumps({"bench": "host_rate", "optimizer": name, "threads": threads, "numel": args.numel,
                              "params_per_s": round(rate), "torch_threads": torch.get_num_threads()}), flush=True)
    same = []
    for use_numpy in (True, False):  # the same parameters after three steps, either way
        with mock.patch.object(optim, "_numpy_sqrt_ok", lambda u=use_numpy: u):
            step = synthetic_update(CONFIGS["portable"], 7, 1 << 16)
            for _ in range(3):
                step()
            same.append(torch.cat([p.detach().flatten() for p in step.params]))
    print(json.dumps({"bench": "host_rate_summary", "portable_over_float64_sqrt": {
        t: round(rates[("portable", t)] / rates[("portable_float64_sqrt", t)], 3) for t in args.threads},
        "same_bits": torch.equal(same[0], same[1])}))


if __name__ == "__main__":
    main()
