"""What coupling two processes into data-parallel replicas costs them, beside the same two processes uncoupled.

Issue 23's transformer target (``torchrun --nproc_per_node=2``'s default layout >= 1.7x one process
on one thread) sits between two figures of ``bench/layouts.py``: one stage x two replicas (what
``auto`` picks) and ``two_halves``, two independent runs on half the batch each (the ceiling of
two processes here). This script splits that gap. Alternating rounds, on the same space:

* ``coupled``: ``torchrun --nproc_per_node=2 -m search pipeline.stages=1 pipeline.window=1``,
  the whole batch: two replicas, each running M / 2 micro-batches, the exact gradient reduction
  and the once-a-step wait for each other before the update;
* ``uncoupled``: two ``torchrun --nproc_per_node=1 -m search`` runs started together, each on half
  the batch with half the micro-batches: the same engine, the same per-process work (the same
  subnets, the same micro-batch shapes), no reduction and no waiting for each other.

and with ``--aligned`` also

* ``aligned``: the two uncoupled runs waiting for each other after every step (a TCP store's
  keys), in a scratch worktree of HEAD with ``bench/patches/align_steps.diff`` applied (the app
  itself has no such switch): the once-a-step wait alone, without the reduction and without
  sharing a job.

All trace the same steps (``pipeline.trace_steps``). Per run: the train time and, per traced
step and kind of span (``forward``, ``backward``, ``optimizer``, ``reduce``: the span's summed
durations in the step), the rank's figure. ``paired``: per kind, the median over the traced
steps of a coupled rank's figure over the mean of the two uncoupled runs' for the same step (the
same subnet), and ``noise_floor``: the second uncoupled run's over the first's (what two
independent runs of the same work differ by). ``paired_actions``: the same per action (``0F0``,
``0B1``, ``0U``, ...). A compute ratio above the noise floor is time a
coupled rank's forward or backward took beyond the same work uncoupled: the two ranks running
the same phases at the same moment (they start every step together), and what else the coupled
process runs on its core. ``optimizer`` includes the reduction (``reduce`` nests in it).

``--tree NAME=PATH`` runs ``coupled`` in another source tree too (a ``git worktree`` with a
change to try), alternating with this one. Outputs ``bench/out/<name>.jsonl``; the baseline
(``uncoupled``) comes from the same rounds.

    flock -x /tmp/bench.lock .venv/bin/python bench/dp_coupling.py [--rounds 3] [--space transformer]
                             [--trace 40 140] [--aligned] [--tree nored=/tmp/nored] [--name dp_coupling]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import ROOT, emit, progress  # noqa: E402
from bench.layouts import COMMON, SPACES, _result, run_env, search_command  # noqa: E402
from pipeline.trace import spans_from_chrome  # noqa: E402

KINDS = ("forward", "backward", "optimizer", "reduce")
ALIGN_PATCH = ROOT / "bench" / "patches" / "align_steps.diff"


@contextlib.contextmanager
def aligned_tree(tmp: Path):
    """A worktree of HEAD with :data:`ALIGN_PATCH` applied (removed on the way out)."""
    where = tmp / "aligned-tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(where), "HEAD"], cwd=ROOT, check=True)
    try:
        subprocess.run(["git", "apply", str(ALIGN_PATCH)], cwd=where, check=True)
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_step(run_dir: Path) -> dict[int, dict[int, dict[str, float]]]:
    """rank -> step -> kind -> seconds (the kind's spans summed over the step) from ``trace.json``;
    also each action's own seconds under its name (``0F0``: stage 0's forward of its first
    micro-batch, ``0U``: the update)."""
    spans = spans_from_chrome(json.loads((run_dir / "trace.json").read_text()))
    out: dict[int, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for s in spans:
        if s.cat in KINDS:
            out[s.rank][s.step][s.cat] += s.dur_s
            if s.cat != "reduce":
                out[s.rank][s.step][s.name] += s.dur_s
    return out


def paired(a: dict[int, dict[str, float]], *bs: dict[int, dict[str, float]],
           keys: tuple[str, ...] = KINDS) -> dict[str, float | None]:
    """Per kind (or action name, ``keys``), the median over the steps all traced of ``a``'s
    seconds over the mean of ``bs``'."""
    ratios = {}
    for kind in keys:
        r = [a[s][kind] / statistics.fmean(b[s][kind] for b in bs) for s in a
             if a[s].get(kind) and all(b.get(s, {}).get(kind) for b in bs)]
        ratios[kind] = round(statistics.median(r), 3) if r else None
    return ratios


def medians_ms(steps: dict[int, dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median([v.get(k, 0.0) for v in steps.values()]) * 1e3, 2) for k in KINDS}


def _launch(nproc: int, overrides: list[str], out: Path, tree: Path, log: Path,
            env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: the run never waits on a full pipe
        return subprocess.Popen([*search_command(nproc), *COMMON, *overrides, f"hydra.run.dir={out}"], cwd=tree,
                                env={**run_env(tree), **(env or {})}, stdout=subprocess.DEVNULL, stderr=f)


def _wait(procs: list[subprocess.Popen], logs: list[Path], what: str) -> None:
    for p, log in zip(procs, logs):
        if p.wait() != 0:
            for q in procs:
                q.kill()
            sys.exit(f"{what} exited {p.returncode}:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--space", default="transformer", choices=list(SPACES))
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the space's in bench/layouts.py)")
    ap.add_argument("--trace", type=int, nargs=2, default=(40, 140), metavar=("FIRST", "END"),
                    help="the traced steps, FIRST .. END - 1")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--aligned", action="store_true",
                    help="also the uncoupled runs waiting for each other after every step (see the docstring)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="run `coupled` in this source tree too, alternating with this one")
    ap.add_argument("--name", default="dp_coupling", help="bench/out/<name>.jsonl")
    args = ap.parse_args(argv)
    extra, steps = SPACES[args.space]
    steps = args.steps or steps
    if not 0 <= args.trace[0] < args.trace[1] <= steps:
        ap.error(f"--trace: expected 0 <= FIRST < END <= {steps} (the steps), found {list(args.trace)}")
    if args.batch % 2 or args.microbatches % 2:
        ap.error(f"--batch and --microbatches: expected even numbers (two halves), found {args.batch}, {args.microbatches}")
    traced = f"pipeline.trace_steps=[{','.join(map(str, range(*args.trace)))}]"
    base = [*extra, f"train.steps={steps}", traced]
    coupled_over = [*base, f"train.batch_size={args.batch}", f"train.microbatches={args.microbatches}",
                    "pipeline.stages=1", "pipeline.window=1"]
    half_over = [*base, f"train.batch_size={args.batch // 2}", f"train.microbatches={args.microbatches // 2}"]
    trees = {"this": ROOT, **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}}
    runs = [("uncoupled", "this"), *([("aligned", "this")] if args.aligned else []), *(("coupled", t) for t in trees)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pipenas-dp-coupling-") as tmp, \
            (aligned_tree(Path(tmp)) if args.aligned else contextlib.nullcontext()) as patched:
        for r in range(args.rounds):
            for kind, tree in (runs if r % 2 == 0 else list(reversed(runs))):
                where = Path(tmp) / f"{kind}-{tree}-{r}"
                progress(f"round {r + 1}/{args.rounds}: {kind} ({tree})")
                if kind == "coupled":
                    log = Path(f"{where}.stderr")
                    _wait([_launch(2, coupled_over, where, trees[tree], log)], [log], f"coupled ({tree})")
                    res = _result(where, 0.0)
                    traces = per_step(where)
                    rows.append({"kind": "run", "run": kind, "tree": tree, "round": r,
                                 "train_time_s": res["train_time_s"], "params_digest": res["params_digest"],
                                 "ran": res["ran"], "ranks": {str(k): medians_ms(v) for k, v in sorted(traces.items())},
                                 "_traces": traces})
                else:
                    dirs = [Path(f"{where}-{k}") for k in range(2)]
                    logs = [Path(f"{d}.stderr") for d in dirs]
                    port = free_port()
                    procs = [_launch(1, half_over, d, ROOT if kind == "uncoupled" else patched, lg,
                                     {} if kind == "uncoupled" else {"ALIGN_PORT": str(port), "ALIGN_ME": str(k)})
                             for k, (d, lg) in enumerate(zip(dirs, logs))]
                    _wait(procs, logs, kind)
                    results = [_result(d, 0.0) for d in dirs]
                    traces = {k: per_step(d)[0] for k, d in enumerate(dirs)}  # run -> its one rank's steps
                    rows.append({"kind": "run", "run": kind, "tree": tree, "round": r,
                                 "train_time_s": max(x["train_time_s"] for x in results),
                                 "train_times_s": [x["train_time_s"] for x in results],
                                 "ranks": {str(k): medians_ms(v) for k, v in traces.items()},
                                 **({"noise_floor": paired(traces[1], traces[0])} if kind == "uncoupled" else {}),
                                 "_traces": traces})
    summary: list[dict[str, Any]] = []
    for r in range(args.rounds):
        base_row = next(x for x in rows if x["round"] == r and x["run"] == "uncoupled")
        for row in (x for x in rows if x["round"] == r and x["run"] != "uncoupled"):
            mine, baseline = row["_traces"], base_row["_traces"].values()
            row["paired"] = {str(k): paired(v, *baseline) for k, v in sorted(mine.items())}
            names = sorted({n for v in mine.values() for st in v.values() for n in st if n not in KINDS})
            row["paired_actions"] = {str(k): paired(v, *baseline, keys=tuple(names)) for k, v in sorted(mine.items())}
            row["over_uncoupled"] = round(row["train_time_s"] / base_row["train_time_s"], 3)
    for row in rows:
        del row["_traces"]
    for kind, tree in runs[1:]:
        mine = [x for x in rows if x["run"] == kind and x["tree"] == tree]
        summary.append({
            "kind": "summary", "run": kind, "tree": tree, "space": args.space, "steps": steps, "rounds": args.rounds,
            "traced": list(args.trace), "train_time_s": statistics.median(x["train_time_s"] for x in mine),
            "uncoupled_train_time_s": statistics.median(x["train_time_s"] for x in rows if x["run"] == "uncoupled"),
            "over_uncoupled": statistics.median(x["over_uncoupled"] for x in mine),
            "over_uncoupled_by_round": [x["over_uncoupled"] for x in mine],
            "paired_by_round": [x["paired"] for x in mine],
            "paired_actions_by_round": [x["paired_actions"] for x in mine],
            "noise_floor_by_round": [x["noise_floor"] for x in rows if x["run"] == "uncoupled"],
            "baseline": "uncoupled: two torchrun --nproc_per_node=1 runs on half the batch each, side by side, same rounds",
        })
    emit(args.name, rows + summary)


if __name__ == "__main__":
    main()
