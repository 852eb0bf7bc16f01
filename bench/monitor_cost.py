"""What the training monitor's scoring costs under torchrun, in this tree and another (before a
change), alternating rounds, one invocation: each run's ``monitor_s`` (the seconds the reference
subnets' scoring took, in metrics.jsonl) and its accuracies, which must match across trees.

    flock -x /tmp/bench.lock .venv/bin/python bench/monitor_cost.py --tree before=/tmp/old
        [--rounds 2] [--nproc 2] [--val-batch-size 40] [--name monitor_cost] [overrides ...]

Each run: ``torchrun --nproc_per_node=<nproc> -m search`` for 200 steps, scored every 50
(``search=none``, no checkpoints), on the transformer w256 l8 by default (the layout the
chooser picks: (1, 2) on two cores). ``--val-batch-size`` sets ``search.val_batch_size``: the
digits' 360 validation samples in that many per batch (the default, 360, is one batch).
One JSON line per run and one summary: per tree the median ``monitor_s`` and the ratio over the
first tree's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _spawn import emit, progress, run_env, search_command  # noqa: E402

COMMON = ["search=none", "train.steps=200", "train.monitor_every=50", "train.checkpoint_every=0",
          "train.tensorboard=false"]
SPACE = ["space=transformer", "space.width=256", "space.layers=8"]


def run(tree: Path, out: Path, nproc: int, overrides: list[str]) -> dict:
    proc = subprocess.run([*search_command(nproc), *COMMON, *overrides, f"hydra.run.dir={out}"], cwd=tree,
                          env=run_env(tree), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{tree}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    scored = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "monitor_s" in m]
    summary = json.loads((out / "summary.json").read_text())
    return {"monitor_s": [m["monitor_s"] for m in scored],
            "accuracies": [[m[k] for k in sorted(m) if k.startswith("monitor/")] for m in scored],
            "layout": {k: summary["layout"][k] for k in ("stages", "replicas", "window")} if "layout" in summary else None,
            "params_digest": summary["params_digest"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH", help="another source tree to run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--val-batch-size", type=int, default=40)
    ap.add_argument("--name", default="monitor_cost")
    ap.add_argument("overrides", nargs="*", help="extra overrides (default: the transformer w256 l8)")
    args = ap.parse_args()
    trees = {name: Path(path) for name, path in (t.split("=", 1) for t in args.tree)}
    trees["this"] = ROOT
    overrides = [*(args.overrides or SPACE), f"search.val_batch_size={args.val_batch_size}"]
    rows, times = [], {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                progress(f"round {r + 1}/{args.rounds}: {name}")
                res = run(trees[name], Path(tmp) / f"{name}-{r}", args.nproc, overrides)
                rows.append({"kind": "run", "tree": name, "round": r, **res})
                times[name] += res["monitor_s"]
    first = next(iter(trees))
    same = len({json.dumps([row["accuracies"], row["params_digest"]]) for row in rows}) == 1
    med = {name: statistics.median(v) for name, v in times.items()}
    rows.append({"kind": "summary", "overrides": overrides, "nproc": args.nproc, "same_results": same,
                 "monitor_s_median": {k: round(v, 4) for k, v in med.items()},
                 "over_first": {k: round(v / med[first], 3) for k, v in med.items()}})
    emit(args.name, rows)


if __name__ == "__main__":
    main()
