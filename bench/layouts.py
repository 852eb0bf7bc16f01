"""The layouts a user can pick by hand against the one ``pipeline.stages=auto`` picks, on this
machine: the training time of the same run in each, alternating rounds, medians, one invocation.

    flock -x /tmp/bench.lock .venv/bin/python bench/layouts.py [--rounds 2] [--spaces default transformer]
        [--layouts one_process flushed window4 stages1 auto] [--name layouts] [--tree before=/tmp/old]

``--tree NAME=PATH`` runs every layout in another source tree too (a ``git worktree`` of an
older commit: the table before a change, in the same invocation), each layout's runs in the
trees back to back, their order alternating by round.

Each round runs every layout once (the order reversed every other round) on each space, from a
fresh run directory, training only (``search=none``, no checkpoints, no monitor), and reads the
run's own ``train_time_s`` (summary.json: training alone, no start-up): the default space for 300
steps, the transformer (``space=transformer space.width=256 space.layers=8``) for 150. Layouts:
``one_process`` (``python -m search threads=1``, the baseline), and under ``torchrun
--nproc_per_node=2``: ``flushed`` (``pipeline.stages=2``, one flushed 1F1B step per subnet: the
default before issue 23), ``flushed_zbh1`` (the same with the backward split, ZB-H1),
``window4`` (two stages, ``pipeline.window=4 pipeline.shared_ops=delayed``; ``window4_zbh1``
with the split), ``window4_d3`` and ``window4_d3_head1`` (``window4`` with D = 3, and with the
head read one update late: ``pipeline.shared_delays={head:1}``), ``window4_d3_bytes`` and
``window4_zbh1_bytes`` (``window4_d3`` and ``window4_zbh1`` with ``pipeline.inflight=bytes``: each
stage's in-flight cap in activation bytes), ``window4_zbh1_bytes_minmax`` (with the planner's
``pipeline.objective=minmax``), ``stages1_window4`` and ``stages1_window4_clip`` (data parallel
across subnets, window 4 delayed, unclipped and clipped), ``flushed_clip`` and ``window4_clip`` (``flushed`` and
``window4`` with ``train.clip_grad_norm=1.0``: what waiting for the global norm before each update
costs), ``stages1``
(``pipeline.stages=1``: data parallel) and ``auto`` (``pipeline.stages=auto
pipeline.window=auto``: the layout chooser's pick, the default under torchrun), and, as the
ceiling of two processes on this machine rather than a layout, ``two_halves``: two one-process
runs started together, each on half the batch in half the micro-batches (a data-parallel
replica's work with no messages, no reduction and no second update; the slower one's time; other
weights), and from the same two runs ``two_halves_synced``: their time had they waited for each
other after every step, as data-parallel replicas do before each update (the slower run's time
outside its steps plus, per step, the slower of the two runs' step times: both run the same arch
at each step), the ceiling of a layout that synchronises once a step. ``window4``
reads shared ops one update late (other weights than the rest: the issue's table has it); the
others compute the same weights.

One JSON line per run (``"kind": "run"``: train time, the layout the run took, the chooser's
prediction for ``auto``), and one per space (``"kind": "space"``): each layout's median train
time and its speed-up over one process (the median of the per-round ratios), the best
hand-picked layout and how far ``auto`` is from it, and with ``two_halves`` what the fastest layout
reaches of that ceiling (``best_over_ceiling``). How much of two cores two processes got is
measured at the start and the end (``bench/search_scaling.py``'s probe: 2.0 on two idle cores).
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
sys.path.insert(0, str(ROOT / "bench"))

from _spawn import emit, progress, run_env, search_command  # noqa: E402
from search_scaling import two_processes_speedup  # noqa: E402

COMMON = ["search=none", "train.checkpoint_every=0", "train.monitor_every=0", "threads=1", "train.tensorboard=false"]
SPACES = {  # name: (overrides, steps)
    "default": ([], 300),
    "transformer": (["space=transformer", "space.width=256", "space.layers=8"], 150),
}
LAYOUTS = {  # name: (processes, overrides)
    "one_process": (1, []),
    "flushed": (2, ["pipeline.stages=2", "pipeline.window=1"]),
    "flushed_zbh1": (2, ["pipeline.stages=2", "pipeline.window=1", "pipeline.schedule=zbh1"]),
    "window4": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed"]),
    "window4_zbh1": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                         "pipeline.schedule=zbh1"]),
    # D = 3 with every shared op at D, and with the head one update late (pipeline.shared_delays): what
    # reading the head sooner costs a real run (other weights again; not among the hand-picked)
    "window4_d3": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                       "pipeline.shared_delay=3"]),
    "window4_d3_head1": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                             "pipeline.shared_delay=3", "pipeline.shared_delays={head:1}"]),
    # the in-flight cap counted in activation bytes (pipeline.inflight=bytes; the same weights as
    # without it): window4_d3 and window4_zbh1 with it
    "window4_d3_bytes": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                             "pipeline.shared_delay=3", "pipeline.inflight=bytes"]),
    "window4_zbh1_bytes": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                               "pipeline.schedule=zbh1", "pipeline.inflight=bytes"]),
    # the same with the planner's minmax objective (the simulated P = 8, M = 4 stream's best settings)
    "window4_zbh1_bytes_minmax": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                                      "pipeline.schedule=zbh1", "pipeline.inflight=bytes",
                                      "pipeline.objective=minmax"]),
    # clipping (train.clip_grad_norm): the norm's wait before each update, flushed and across subnets
    "flushed_clip": (2, ["pipeline.stages=2", "pipeline.window=1", "train.clip_grad_norm=1.0"]),
    "window4_clip": (2, ["pipeline.stages=2", "pipeline.window=4", "pipeline.shared_ops=delayed",
                         "train.clip_grad_norm=1.0"]),
    "stages1": (2, ["pipeline.stages=1", "pipeline.window=1"]),
    # data parallel across subnets, unclipped and clipped (each replica folds at the update, then clips)
    "stages1_window4": (2, ["pipeline.stages=1", "pipeline.window=4", "pipeline.shared_ops=delayed"]),
    "stages1_window4_clip": (2, ["pipeline.stages=1", "pipeline.window=4", "pipeline.shared_ops=delayed",
                                 "train.clip_grad_norm=1.0"]),
    "auto": (2, ["pipeline.stages=auto", "pipeline.window=auto"]),
    # the ceiling of two processes here, not a layout: two one-process runs at once, each on half the
    # batch in half the micro-batches (a data-parallel replica's work, with no messages, reduction or
    # second update); their slower train time
    "two_halves": (2, ["train.batch_size=32", "train.microbatches=2"]),
}
SYNCED = "two_halves_synced"  # two_halves's runs, each step ending with the slower one's (see run_halves)
HAND_PICKED = ("one_process", "flushed", "flushed_zbh1", "window4", "window4_zbh1", "stages1")


def _overrides(tree: Path, name: str) -> list[str]:
    """A layout's overrides in ``tree``: a tree without the layout chooser (before issue 23's
    parts 1-2) has no ``pipeline.window=auto``, its ``auto`` is ``pipeline.stages=auto`` alone."""
    over = LAYOUTS[name][1]
    if name == "auto" and "def choose_layout" not in (tree / "pipeline" / "layout.py").read_text():
        over = [o for o in over if o != "pipeline.window=auto"]
    return over


def run_layout(out: Path, nproc: int, overrides: list[str], tree: Path = ROOT) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([*search_command(nproc), *COMMON, *overrides, f"hydra.run.dir={out}"], cwd=tree,
                          env=run_env(tree),
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(overrides)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return _result(out, wall)


def run_halves(out: Path, overrides: list[str], tree: Path = ROOT) -> dict[str, Any]:
    """``two_halves``: two one-process runs started together, each on half the batch; the slower
    one's train time (the run finishes when both have)."""
    logs = [Path(f"{out}-{k}.stderr") for k in range(2)]  # files, not pipes: neither run waits on a full pipe
    t0 = time.perf_counter()
    procs = []
    for k, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([*search_command(1), *COMMON, *overrides,
                                           f"hydra.run.dir={out}-{k}"], cwd=tree, env=run_env(tree),
                                          stdout=subprocess.DEVNULL, stderr=f))
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - t0
    for code, log in zip(codes, logs):
        if code != 0:
            sys.exit(f"two_halves {' '.join(overrides)} exited {code}:\n{log.read_text()[-3000:]}")
    results = [_result(Path(f"{out}-{k}"), wall) for k in range(2)]
    slower = max(range(2), key=lambda k: results[k]["train_time_s"])
    steps = [_step_seconds(Path(f"{out}-{k}")) for k in range(2)]
    res = results[slower]
    res["synced_train_time_s"] = round(synced_time(res["train_time_s"], steps, slower), 3)
    return res


def synced_time(train_time_s: float, steps: list[list[float]], slower: int) -> float:
    """Runs that ran side by side, had they waited for each other after every step (as
    data-parallel replicas do before their update): run ``slower``'s train time outside its steps,
    plus per step the longest of the runs' step times (``steps[k][i]``: run k's step i)."""
    if len({len(s) for s in steps}) != 1:
        raise ValueError(f"synced_time: expected runs of as many steps, found {[len(s) for s in steps]}")
    return train_time_s - sum(steps[slower]) + sum(map(max, zip(*steps)))


def _step_seconds(out: Path) -> list[float]:
    return [json.loads(line)["seconds"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _result(out: Path, wall: float) -> dict[str, Any]:
    s = json.loads((out / "summary.json").read_text())
    layout = s.get("layout") or {}
    return {"train_time_s": s["train_time_s"], "wall_s": round(wall, 2), "world_size": s["world_size"],
            "steps": s["steps"], "final_loss": s["final_loss"], "params_digest": s["params_digest"],
            "ran": {k: layout.get(k) for k in ("stages", "replicas", "window", "predicted_samples_per_s", "costs")},
            "predicted": layout.get("options") or None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spaces", nargs="+", default=list(SPACES), choices=list(SPACES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=None, help="steps on every space (default: 300 / 150)")
    ap.add_argument("--name", default="layouts", help="bench/out/<name>.jsonl")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="run every layout in this source tree too (e.g. before=/tmp/old: a git worktree), "
                         "alternating with this one; rows carry the tree's name")
    args = ap.parse_args(argv)
    trees = {"this": ROOT, **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}}
    capacity = [two_processes_speedup()]
    rows: list[dict[str, Any]] = []
    times: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="pipenas-layouts-") as tmp:
        for r in range(args.rounds):
            order = args.layouts if r % 2 == 0 else list(reversed(args.layouts))
            tree_order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for space in args.spaces:
                extra, steps = SPACES[space]
                steps = args.steps or steps
                for name in order:
                    for tree in tree_order:
                        nproc = LAYOUTS[name][0]
                        where, over = Path(tmp) / f"{tree}-{space}-{name}-{r}", [*extra, f"train.steps={steps}",
                                                                                  *_overrides(trees[tree], name)]
                        res = (run_halves(where, over, trees[tree]) if name == "two_halves" else
                               run_layout(where, nproc, over, trees[tree]))
                        times.setdefault((tree, space, name), []).append(res["train_time_s"])
                        if name == "two_halves":
                            times.setdefault((tree, space, SYNCED), []).append(res["synced_train_time_s"])
                        row = {"kind": "run", "tree": tree, "space": space, "layout": name, "round": r, **res}
                        rows.append(row)
                        progress(json.dumps({k: row[k] for k in ("tree", "space", "layout", "round", "train_time_s",
                                                                 "ran")}))
    capacity.append(two_processes_speedup())
    for tree in trees:
        for space in args.spaces:
            base = times.get((tree, space, "one_process"))
            summary: dict[str, Any] = {"kind": "space", "tree": tree, "space": space, "rounds": args.rounds,
                                       "steps": args.steps or SPACES[space][1], "overrides": SPACES[space][0]}
            for name in [*args.layouts, *([SYNCED] if "two_halves" in args.layouts else [])]:
                t = times[(tree, space, name)]
                summary[name] = {"train_time_s": round(statistics.median(t), 2), "by_round": t,
                                 "speedup": (round(statistics.median(b / x for b, x in zip(base, t)), 3)
                                             if base else None)}
            hand = [n for n in HAND_PICKED if n in args.layouts]
            if "auto" in args.layouts and hand:
                best = min(hand, key=lambda n: summary[n]["train_time_s"])
                summary["best_hand_picked"] = best
                summary["auto_over_best"] = round(summary["auto"]["train_time_s"] / summary[best]["train_time_s"], 3)
            if "two_halves" in args.layouts:  # what the best layout reaches of two processes' ceiling here
                best = max((n for n in args.layouts if n not in ("one_process", "two_halves")),
                           key=lambda n: summary[n]["speedup"] or 0, default=None)
                if best is not None and summary[best]["speedup"] and summary["two_halves"]["speedup"]:
                    summary["best_over_ceiling"] = {best: round(summary[best]["speedup"]
                                                                / summary["two_halves"]["speedup"], 3)}
                    summary["best_over_synced_ceiling"] = {best: round(summary[best]["speedup"]
                                                                       / summary[SYNCED]["speedup"], 3)}
            mine = [row for row in rows if row["tree"] == tree and row["space"] == space and row["layout"] == "auto"]
            summary["auto_picked"] = [row["ran"] for row in mine]
            summary["auto_predicted"] = mine[-1]["predicted"] if mine else None
            rows.append(summary)
    rows.append({"kind": "machine", "cpus": os.cpu_count(),
                 "two_processes_speedup": {"start": capacity[0], "end": capacity[1]}})
    emit(args.name, rows)


if __name__ == "__main__":
    main()
