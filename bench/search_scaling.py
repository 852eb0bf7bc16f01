"""The search phase under torchrun against one process: the default search (evolution, 96
subnets scored) on the same trained supernet, timed from the runs' own ``search_time_s``
(summary.json: the search phase alone, no start-up, no training), in one invocation.

    flock -x /tmp/bench.lock .venv/bin/python bench/search_scaling.py [--steps 600] [--rounds 2] [--nproc 2]

The supernet is trained once (one process, ``search=none``); each mode then runs in a copy of
that run directory, resumes at the last step and only searches: one process (the baseline),
torchrun N = ``--nproc`` with ``search.parallel=false`` (every arch scored by a pipelined
evaluation over all stages, as before issue 23 part 3) and with ``search.parallel=true`` (each
rank scores its share of every batch). Modes alternate their order each round. Prints one JSON
line per run (``"kind": "run"``) and a summary: each mode's median search time, the ratios to
the one-process baseline (medians of the per-round ratios, and each round's), and whether every
run chose the same arch with the same scores (search-evolution.jsonl and summary.json's top_k,
byte for byte). This machine is shared, so the summary also says how much of two cores two
processes got at the start and at the end (``two_processes_speedup``: a fixed single-threaded
workload run alone, then twice at once; 2.0 on two idle cores, 1.0 when they get one core
between them), with the load average: the parallel search cannot beat 1 / that speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _spawn import emit, run_env, search_command  # noqa: E402

COMMON = ["threads=1", "train.checkpoint_every=0", "train.monitor_every=0"]
MODES = {  # name: (processes, overrides)
    "one_process": (1, []),
    "pipelined": (None, ["search.parallel=false"]),
    "parallel": (None, ["search.parallel=true"]),
}


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _probe_work(start: float) -> float:
    """A fixed single-threaded compute workload begun at wall-clock time ``start`` (``--probe``:
    processes started together compute together, not while the other imports torch); returns its
    wall seconds (~1 s on an idle core of the 2-core machine)."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
    time.sleep(max(0.0, start - time.time()))
    t0 = time.perf_counter()
    for _ in range(3000):
        x = torch.tanh(x @ x / 192)
    return time.perf_counter() - t0


def two_processes_speedup() -> dict[str, float]:
    """The probe alone, then two at once: how many cores' worth two processes got (2.0: two idle cores)."""
    def cmd() -> list[str]:
        return [sys.executable, str(Path(__file__)), "--probe", str(time.time() + 4.0)]

    alone = float(subprocess.run(cmd(), capture_output=True, text=True, check=True).stdout)
    at = cmd()
    pair = [subprocess.Popen(at, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    together = max(float(p.communicate()[0]) for p in pair)
    return {"alone_s": round(alone, 3), "together_s": round(together, 3), "speedup": round(2 * alone / together, 2),
            "loadavg": round(os.getloadavg()[0], 2)}


def search_run(base: Path, out: Path, nproc: int, overrides: list[str]) -> dict[str, Any]:
    """Search the trained supernet in ``base`` (copied to ``out``) with ``nproc`` processes."""
    shutil.copytree(base, out)
    wall = _run([*search_command(nproc), *COMMON, *overrides, f"hydra.run.dir={out}"])
    summary = json.loads((out / "summary.json").read_text())
    section = summary["searches"]["evolution"]
    return {"search_time_s": section["search_time_s"], "wall_s": round(wall, 2), "world_size": summary["world_size"],
            "resumed_from_step": summary["resumed_from_step"], "evaluated": section["evaluated"],
            "best": section["best"]["arch"], "best_val_accuracy": section["best"]["val_accuracy"],
            "same_as": json.dumps({"top_k": section["top_k"], "history": section["best_per_generation"],
                                   "log": (out / "search-evolution.jsonl").read_text()}, sort_keys=True)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600, help="training steps before the search (default: the run's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--probe", type=float, help=argparse.SUPPRESS)  # one run of the capacity probe, at this time
    ap.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. search.population=8)")
    args = ap.parse_args(argv)
    if args.probe is not None:
        print(_probe_work(args.probe))
        return
    capacity = [two_processes_speedup()]
    rows: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {m: [] for m in MODES}
    same: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="pipenas-search-scaling-") as tmp:
        base = Path(tmp) / "trained"
        train_s = _run([*search_command(1), *COMMON, *args.overrides, f"train.steps={args.steps}",
                        "search=none", f"hydra.run.dir={base}"])
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                nproc, extra = MODES[mode]
                res = search_run(base, Path(tmp) / f"{mode}-{r}", nproc or args.nproc,
                                 [*args.overrides, f"train.steps={args.steps}", "search=evolution", *extra])
                same.add(res.pop("same_as"))
                times[mode].append(res["search_time_s"])
                rows.append({"kind": "run", "mode": mode, "round": r, **res})
    capacity.append(two_processes_speedup())
    base_t = times["one_process"]
    ratio = {m: statistics.median(t / b for t, b in zip(times[m], base_t)) for m in ("pipelined", "parallel")}
    rows.append({
        "kind": "summary", "nproc": args.nproc, "train_steps": args.steps, "rounds": args.rounds,
        "training_once_s": round(train_s, 1),
        **{f"{m}_search_s": round(statistics.median(t), 3) for m, t in times.items()},
        "pipelined_vs_one_process": round(ratio["pipelined"], 3),
        "parallel_vs_one_process": round(ratio["parallel"], 3),
        "parallel_vs_one_process_by_round": [round(t / b, 3) for t, b in zip(times["parallel"], base_t)],
        "parallel_vs_pipelined": round(statistics.median(a / b for a, b in zip(times["parallel"], times["pipelined"])),
                                       3),
        "target_parallel_vs_one_process": 0.6,
        "same_best_and_scores": len(same) == 1,
        "cpus": os.cpu_count(),
        "two_processes_speedup": {"start": capacity[0], "end": capacity[1]},
    })
    emit("search_scaling", rows)


if __name__ == "__main__":
    main()
