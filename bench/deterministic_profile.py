"""Which CUDA kernels deterministic mode slows: a transformer subnet's forward and backward under
torch's profiler, with ``deterministic`` on and off (``pipeline/determinism.py``), the top kernels
by device time side by side. Needs CUDA.

    python bench/deterministic_profile.py [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.split_backward import SETTINGS, _graph  # noqa: E402
from pipeline.determinism import use_deterministic_kernels  # noqa: E402
from supernet import SliceRun, build_op, cut  # noqa: E402
from supernet.ops import op_contexts  # noqa: E402


def kernels(on: bool, steps: int, batch: int) -> dict[str, float]:
    use_deterministic_kernels("cuda", on)
    graph, shape = _graph(SETTINGS["transformer w256 l8"])
    active = graph.active_ops(graph.space().random(random.Random(0)))
    modules = {op.op_id: build_op(op.spec, op.op_id, 0).to("cuda") for op in active}
    (whole,) = cut(active, [0, len(active)], graph.output)
    x = torch.randn(batch, *shape, device="cuda")

    def step() -> None:
        run = SliceRun(whole, modules.__getitem__, op_contexts(0, 0, 0, True))
        out = run.forward([x])
        run.backward([torch.ones_like(o) for o in out])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out: dict[str, float] = {"(wall ms per step)": wall}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            out[e.key[:90]] = out.get(e.key[:90], 0.0) + t / 1e3 / steps
        if e.self_cpu_time_total:
            k = "cpu: " + e.key[:85]
            out[k] = out.get(k, 0.0) + e.self_cpu_time_total / 1e3 / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    off = kernels(False, args.steps, args.batch)
    on = kernels(True, args.steps, args.batch)
    names = sorted(set(on) | set(off), key=lambda k: -(on.get(k, 0) - off.get(k, 0)))
    def total(d: dict[str, float], cpu: bool) -> float:
        return round(sum(v for k, v in d.items() if k.startswith("cpu: ") == cpu and not k.startswith("(")), 3)

    print(json.dumps({"bench": "deterministic_profile", "wall_ms_per_step_on": round(on["(wall ms per step)"], 3),
                      "wall_ms_per_step_off": round(off["(wall ms per step)"], 3),
                      "device_ms_per_step_on": total(on, False), "device_ms_per_step_off": total(off, False),
                      "cpu_ms_per_step_on": total(on, True), "cpu_ms_per_step_off": total(off, True)}))
    for k in names[:16]:
        print(json.dumps({"kernel": k, "on_ms": round(on.get(k, 0), 4), "off_ms": round(off.get(k, 0), 4)}))


if __name__ == "__main__":
    main()
