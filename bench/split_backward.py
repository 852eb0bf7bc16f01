"""The split backward's cost (issue 23 part 4): a stage's whole backward against its B and W.

One process, one thread (or the GPU), the same slice of a subnet (the second half of the app's
transformer at ``--width``/``--layers``, or ``--space``): per round, the forward then the whole
backward (``SliceRun``), and the forward then B (input gradients, with the graph walk that finds
where W starts) and W (weight gradients) of a split run, alternating; medians over ``--repeats``.
One JSON line per setting: the three times, the walk's share of B, and (B + W) / whole, the split's
overhead, which on a GPU is what a zero-bubble schedule has to win back from the bubbles it fills.

    .venv/bin/python bench/split_backward.py [--device cpu|cuda] [--repeats 30] [--batch 16]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import supernet.execute as execute  # noqa: E402
from supernet import SliceRun, build_op, cut  # noqa: E402
from supernet.ops import op_contexts  # noqa: E402

SETTINGS = {  # name: the app's overrides
    "transformer w256 l8": ["space=transformer", "space.width=256", "space.layers=8"],
    "transformer w128 l8": ["space=transformer", "space.width=128", "space.layers=8"],
    "conv (default)": [],
}


def _graph(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import supernet.spaces  # noqa: F401
    from search.config import build_data, build_space, load_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        rc = load_config(compose("config", overrides=overrides))
    data = build_data(rc.data)
    return build_space(rc.space, data.input_shape, data.num_classes), data.input_shape


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(overrides: list[str], device: str, repeats: int, batch: int, seed: int = 0) -> dict:
    graph, shape = _graph(overrides)
    active = graph.active_ops(graph.space().random(random.Random(seed)))
    modules = {op.op_id: build_op(op.spec, op.op_id, 0).to(device) for op in active}
    first, second = cut(active, [0, len(active) // 2, len(active)], graph.output)
    x = torch.randn(batch, *shape, device=device)
    inputs = [t.detach() for t in SliceRun(first, modules.__getitem__, op_contexts(0, 0, 0, True)).forward([x])]
    walk: list[float] = []
    real_walk = execute._weight_edges

    def timed_walk(*a):
        t0 = time.perf_counter()
        out = real_walk(*a)
        walk.append(time.perf_counter() - t0)
        return out

    execute._weight_edges = timed_walk
    whole, b_s, w_s = [], [], []
    try:
        for r in range(repeats + 3):  # the first rounds warm up
            for split in ((False, True) if r % 2 == 0 else (True, False)):
                run = SliceRun(second, modules.__getitem__, op_contexts(0, 0, 0, True), split=split)
                out = run.forward(inputs)
                grads = [torch.ones_like(o) for o in out]
                _sync(device)
                t0 = time.perf_counter()
                run.backward(grads)
                _sync(device)
                t1 = time.perf_counter()
                if split:
                    run.backward_weight()
                    _sync(device)
                t2 = time.perf_counter()
                for m in modules.values():
                    m.zero_grad(set_to_none=True)
                if r < 3:
                    continue
                if split:
                    b_s.append(t1 - t0)
                    w_s.append(t2 - t1)
                else:
                    whole.append(t1 - t0)
    finally:
        execute._weight_edges = real_walk
    med = {k: statistics.median(v) for k, v in (("whole", whole), ("B", b_s), ("W", w_s), ("walk", walk[-repeats:]))}
    return {"bench": "split_backward", "device": device, "ops_in_slice": len(second.ops), "batch": batch,
            "repeats": repeats, "whole_ms": round(1e3 * med["whole"], 3), "B_ms": round(1e3 * med["B"], 3),
            "W_ms": round(1e3 * med["W"], 3), "walk_ms": round(1e3 * med["walk"], 3),
            "split_over_whole": round((med["B"] + med["W"]) / med["whole"], 3),
            "B_over_whole": round(med["B"] / med["whole"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--setting", action="append", choices=sorted(SETTINGS), help="default: all")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/split_backward.py --device cuda: torch sees no CUDA device")
    torch.set_num_threads(1)
    for name in args.setting or list(SETTINGS):
        print(json.dumps({"setting": name, **measure(SETTINGS[name], args.device, args.repeats, args.batch)}),
              flush=True)


if __name__ == "__main__":
    main()
