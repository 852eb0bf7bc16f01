"""Issue 16: pipeline x data parallel - the mesh planner's (S, R) and real runs side by side.

Two kinds of JSON lines:

* ``simulated``: NASPipe's transformer space (48 choice layers, width 1024, micro-batches of 8
  sequences of 128 tokens, analytic costs at GPU-like rates, a 100 GB/s link as in
  bench/naspipe_planner.py) at N = 8, 16, 32 processes with M = 32 micro-batches per step:
  every (S, R) with S x R = N, its predicted pipeline time, reduction time and samples/s
  (pipeline/plan/mesh.py, exact reduction), and the planner's pick.
* ``real``: this machine, the default space and config (shortened: --steps training steps,
  a tiny search), ``torchrun --nproc_per_node=2 -m search pipeline.stages=1`` (S=1, R=2) beside
  ``pipeline.stages=2`` (S=2, R=1), the same invocation otherwise: median samples/s of the
  steps after the first 5, the mean time per step in the gradient reduction (rank 0's
  ``reduce`` spans of the traced steps) and the final params_digest (equal: the reduction is exact).

    python bench/data_parallel.py [--steps 40] [--skip-real]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._spawn import emit  # noqa: E402
from bench.naspipe_planner import SOURCES  # noqa: E402
from pipeline.plan.costs import analytic_costs, mean_problem  # noqa: E402
from pipeline.plan.mesh import mesh_options, recommend  # noqa: E402
from supernet.spaces import transformer  # noqa: E402

NASPIPE = SOURCES["analytic"]
M = 32


def simulated() -> list[dict]:
    cfg = NASPIPE
    graph = transformer.build(input_shape=cfg["sample_shape"], num_classes=10, preset="naspipe", layers=48,
                              width=cfg["width"])
    table = analytic_costs(graph, cfg["sample_shape"], cfg["microbatch"], "sgd", **cfg["rates"])
    mean = mean_problem(graph, table, num_stages=1, num_microbatches=M)
    rows = []
    for n in (8, 16, 32):
        opts = mesh_options(mean, n, M, cfg["microbatch"], cfg["link"]["bandwidth"], cfg["link"]["latency_s"])
        best = recommend(opts)
        rows.append({"kind": "simulated", "space": "naspipe", "world": n, "microbatches": M,
                     "pick": [best.stages, best.replicas],
                     "options": [{"stages": o.stages, "replicas": o.replicas, "pipeline_ms": 1e3 * o.pipeline_s,
                                  "reduce_ms": 1e3 * o.reduce_s, "samples_per_s": o.samples_per_s,
                                  "vs_pick": o.samples_per_s / best.samples_per_s} for o in opts]})
    return rows


def real(steps: int) -> dict:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    traced = list(range(5, steps))
    out: dict = {"kind": "real", "space": "conv (default config)", "steps": steps}
    for stages in (1, 2):
        d = Path(tempfile.mkdtemp(prefix="pipenas-dp-"))
        cmd = [torchrun, "--nproc_per_node=2", "-m", "search", f"train.steps={steps}", "search.population=4",
               "search.generations=1", f"pipeline.stages={stages}", f"pipeline.trace_steps={traced}",
               f"output_dir={d}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r.get("step", 0) >= 5]
        events = json.loads((d / "trace.json").read_text())["traceEvents"]  # pipeline.trace.chrome_trace
        reduce_us = sum(e.get("dur", 0) for e in events if e.get("cat") == "reduce" and e.get("pid") == 0)
        summary = json.loads((d / "summary.json").read_text())
        out[f"S{stages}_R{2 // stages}"] = {
            "command": " ".join(["torchrun", *cmd[1:]]), "samples_per_s_median": statistics.median(rates),
            "reduce_ms_per_step": reduce_us / 1e3 / len(traced), "wall_s": wall,
            "params_digest": summary.get("params_digest")}
    a, b = out["S1_R2"], out["S2_R1"]
    out["replicas_over_stages"] = a["samples_per_s_median"] / b["samples_per_s_median"]
    out["same_digest"] = a["params_digest"] == b["params_digest"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    rows = simulated()
    if not args.skip_real:
        rows.append(real(args.steps))
    emit("data_parallel", rows)


if __name__ == "__main__":
    main()
