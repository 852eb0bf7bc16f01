"""What a run costs before and after its work: the wall time of a short ``python -m search`` and
of a short ``torchrun --nproc_per_node=2`` job, against another source tree in the same run.

    flock -x /tmp/bench.lock .venv/bin/python bench/startup.py --tree before=/tmp/old [--rounds 5]

A short run is mostly start-up: importing torch, Hydra and the project, composing the config,
building the supernet, the first optimizer and the FLOP count, the teardown. Each round runs
every launch once in each tree, back to back, the trees' order alternating by round, each from a
fresh run directory (no checkpoint to resume). One JSON line per run (wall seconds, the run's own
``train_time_s``, its ``params_digest``), and one per launch: the median wall time in each tree,
the median of the per-round ratios (the other tree over this one), and whether the digests agree.
``--tree`` is a ``git worktree`` of an older commit (``git worktree add -f /tmp/old <rev> --detach``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _spawn import emit, progress, run_env, search_command  # noqa: E402

SHORT = ["train.steps=12", "train.warmup_steps=2", "search.population=4", "search.generations=1", "threads=1",
         "train.tensorboard=false"]
LAUNCHES = {  # name: (processes, overrides)
    "one_process": (1, []),
    "torchrun_2": (2, ["pipeline.stages=2"]),
}


def run_once(tree: Path, nproc: int, overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="startup-")) / "run"
    t0 = time.perf_counter()
    proc = subprocess.run([*search_command(nproc), *SHORT, *overrides, f"hydra.run.dir={out}"], cwd=tree,
                          env=run_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{tree}: {' '.join(overrides)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"wall_s": round(wall, 3), "train_time_s": s["train_time_s"], "params_digest": s["params_digest"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", nargs="+", default=list(LAUNCHES), choices=list(LAUNCHES))
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH", required=True,
                    help="another source tree to time beside this one")
    ap.add_argument("--name", default="startup", help="bench/out/<name>.jsonl")
    args = ap.parse_args(argv)
    trees = {"this": ROOT, **{n: Path(p).resolve() for n, p in (t.split("=", 1) for t in args.tree)}}
    runs: dict[tuple[str, str], list[dict]] = {}
    rows: list[dict] = []
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for launch in args.launches:
            nproc, over = LAUNCHES[launch]
            for name in order:
                got = run_once(trees[name], nproc, over)
                runs.setdefault((launch, name), []).append(got)
                rows.append({"kind": "run", "launch": launch, "tree": name, "round": r, **got})
                progress(f"round {r + 1}/{args.rounds} {launch} {name}: {got['wall_s']:.2f} s")
    for launch in args.launches:
        this = runs[(launch, "this")]
        row = {"kind": "launch", "launch": launch, "rounds": args.rounds,
               "this_wall_s": statistics.median(x["wall_s"] for x in this)}
        for name in trees:
            if name == "this":
                continue
            other = runs[(launch, name)]
            row[f"{name}_wall_s"] = statistics.median(x["wall_s"] for x in other)
            ratios = [o["wall_s"] / t["wall_s"] for o, t in zip(other, this)]
            row[f"{name}_over_this"] = round(statistics.median(ratios), 3)
            row[f"{name}_same_digest"] = all(o["params_digest"] == t["params_digest"] for o, t in zip(other, this))
        rows.append(row)
    emit(args.name, rows)


if __name__ == "__main__":
    main()
