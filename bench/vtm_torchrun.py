"""The tensor manager under torchrun: the app's default search run, P pipeline stages (gloo on
CPU, NCCL on GPU), with a per-stage device budget against the same run all-resident, in the
same invocation, alternating the order each round.

    flock /tmp/pipenas-bench.lock .venv/bin/python bench/vtm_torchrun.py [--rounds 3] [--scale 0.6]

The budget is ``--scale`` x the largest subnet's footprint (with the run's optimizer placement):
below 1, no stage could hold a whole subnet, so the partitioner has to split every subnet so
that each stage's share fits its arena (pipeline/memory/sizing.py). Prints one JSON line per run
(``"kind": "run"``) and a summary: the median step time of each mode (metrics.jsonl, steps after
the first), the overhead (median of the per-round ratios and their range), training time, whether
every run trained the same weights (``params_digest``), and rank 0's manager figures.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vtm_cpu import footprints  # noqa: E402  (the same budget rule as the one-process bench)

COMMON = ["threads=1", "train.checkpoint_every=0"]


def one_run(overrides: list[str], stages: int, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={stages}", "-m", "search",
               *overrides, f"device={device}", f"hydra.run.dir={out}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        steps = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    secs = [r["seconds"] for r in steps[1:]]
    moving = [r for r in steps[1:] if r["migrated_ops"] > 0]
    return {"wall_s": round(wall, 2), "train_time_s": summary["train_time_s"],
            "step_s_median": statistics.median(secs), "params_digest": summary["params_digest"],
            # steps where ops moved: the median time moving them on rank 0's critical path, and bytes
            "migrating_steps": len(moving),
            "migration_s_median": statistics.median(r["migration_s"] for r in moving) if moving else 0.0,
            "migrated_bytes_per_step": statistics.fmean(r["migrated_bytes"] for r in steps),
            "memory": summary.get("memory")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.6, help="budget = scale x the largest subnet's footprint")
    ap.add_argument("--optimizer", default="host", choices=("host", "device"), help="memory.optimizer")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both modes")
    args = ap.parse_args(argv)
    base = [*COMMON, *args.overrides]
    supernet_bytes, largest = footprints([*base, f"device={args.device}"], args.optimizer)
    budget = int(largest * args.scale)
    modes = {"resident": base,
             "budget": [*base, f"memory.device_budget_bytes={budget}", f"memory.optimizer={args.optimizer}"]}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            res = one_run(modes[mode], args.stages, args.device)
            runs[mode].append(res)
            print(json.dumps({"kind": "run", "mode": mode, "round": r, **res}), flush=True)
    ratios = [b["step_s_median"] / a["step_s_median"] for a, b in zip(runs["resident"], runs["budget"])]
    train = [b["train_time_s"] / a["train_time_s"] for a, b in zip(runs["resident"], runs["budget"])]
    mem = runs["budget"][0]["memory"] or {}
    print(json.dumps({
        "kind": "summary", "stages": args.stages, "device": args.device, "optimizer": args.optimizer,
        "supernet_bytes": supernet_bytes, "largest_subnet_bytes": largest, "budget_bytes": budget,
        "oversubscription_per_stage": round(supernet_bytes / args.stages / budget, 2), "rounds": args.rounds,
        "step_s_median_resident": statistics.median(x["step_s_median"] for x in runs["resident"]),
        "step_s_median_budget": statistics.median(x["step_s_median"] for x in runs["budget"]),
        "overhead_pct_step": round(100 * (statistics.median(ratios) - 1), 2),
        "paired_step_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "overhead_pct_train": round(100 * (statistics.median(train) - 1), 2),
        "same_digest": len({x["params_digest"] for rs in runs.values() for x in rs}) == 1,
        "migration_s_median_resident": statistics.median(x["migration_s_median"] for x in runs["resident"]),
        "migration_s_median_budget": statistics.median(x["migration_s_median"] for x in runs["budget"]),
        "rank0_memory": mem,
    }), flush=True)


if __name__ == "__main__":
    main()
