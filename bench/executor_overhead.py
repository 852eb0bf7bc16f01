"""Issue 8: the reference engine's step against a plain PyTorch step on the same subnets.

One process, one intra-op thread. Per space (transformer: the issue-8 subnet at width 64 and
256; conv and cell: the app's presets on digits-sized inputs), the same fixed list of subnets
(``space.random(random.Random(seed))``), the same batch split into M micro-batches:

* **reference**: ``ReferenceEngine.train_step`` (the per-op executor of ``supernet/execute.py``,
  per-op optimizers);
* **plain**: ``Supernet(x, arch)`` with plain autograd, one ``backward`` per micro-batch, one
  ``torch.optim.SGD`` over the supernet's parameters (ops without gradients are skipped), the
  same loss.

Both in the same process, in alternating blocks of steps (order flipped every block); median
step time per side; one JSON line per space with the ratio reference / plain.

    python bench/executor_overhead.py [--steps 40] [--block 5]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import emit, progress  # noqa: E402

SPACES = {
    "transformer64": ("transformer", (32, 32), dict(layers=8, width=64, candidates=["attn2", "ffn2", "conv3", "identity"])),
    "transformer256": ("transformer", (32, 32), dict(layers=8, width=256, candidates=["attn2", "ffn2", "conv3", "identity"])),
    "conv": ("conv", (1, 8, 8), {}),
    "cell": ("cell", (1, 8, 8), {}),
}


def measure(name: str, steps: int, block: int, batch: int, M: int, seed: int) -> dict:
    from pipeline import LrSchedule, OptimConfig, ReferenceEngine
    from supernet import Supernet, classification_loss
    from supernet.spaces import build_space

    kind, sample, options = SPACES[name]
    graph = build_space(kind, input_shape=sample, num_classes=10, **options)
    rng = random.Random(seed)
    archs = [graph.space().random(rng) for _ in range(8)]
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, *sample, generator=g), torch.randint(0, 10, (batch,), generator=g)
    optim = OptimConfig(name="sgd", lr=0.01, momentum=0.9, weight_decay=1e-4)
    ref = ReferenceEngine(graph, seed, optim, M, LrSchedule(optim.lr, 10**6), "cpu")
    net = Supernet(graph, seed)
    opt = torch.optim.SGD(net.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    counter = [0, 0]

    def run_ref() -> None:
        i = counter[0]
        ref.train_step(i, archs[i % len(archs)], x, y)
        counter[0] += 1

    def run_plain() -> None:
        i = counter[1]
        arch = archs[i % len(archs)]
        for mb, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
            classification_loss(net(xm, arch, step=i, microbatch=mb), ym, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter[1] += 1

    sides = {"reference": run_ref, "plain": run_plain}
    for fn in sides.values():
        for _ in range(len(archs)):
            fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for b in range(steps // block):
        for side in (order if b % 2 == 0 else order[::-1]):
            for _ in range(block):
                t0 = time.perf_counter()
                sides[side]()
                times[side].append(time.perf_counter() - t0)
    r, p = statistics.median(times["reference"]), statistics.median(times["plain"])
    paired = statistics.median(a / b for a, b in zip(times["reference"], times["plain"]))
    return {"bench": "executor_overhead", "space": name, "batch": batch, "M": M, "steps_measured": len(times["plain"]),
            "reference_step_ms": 1e3 * r, "plain_step_ms": 1e3 * p, "reference_over_plain": r / p,
            "reference_over_plain_paired_median": paired, "cores": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "baseline": "Supernet(x, arch) + loss.backward() per micro-batch + one torch.optim.SGD, same process, "
                        "alternating blocks"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spaces", nargs="+", default=list(SPACES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.spaces:
        progress(f"{name} ...")
        rows.append(measure(name, args.steps, args.block, args.batch, args.microbatches, args.seed))
    emit("executor_overhead", rows)


if __name__ == "__main__":
    main()
