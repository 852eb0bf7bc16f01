"""Issue 25: does training hold at the default settings, in every shared-op mode?

For each space and each number of steps, three one-process runs of the app (``python -m search``,
``sampler=fair search=none``, each space's preset: its own training settings where it carries
them, ``train/default.yaml`` otherwise):

* ``exact``: shared ops read exactly (sequential training);
* ``delayed1``: ``pipeline.shared_ops=delayed pipeline.shared_delay=1 pipeline.window=4``;
* ``delayed4``: the same with ``pipeline.shared_delay=4``;
* ``delayed4-head1`` (not run by default): ``delayed4`` with the head read one update late
  (``pipeline.shared_delays={head:1}``).

``--compensations RULE[:COEF] ...`` adds, for each delayed mode, a run with
``pipeline.delay_compensation=RULE`` (and ``pipeline.delay_compensation_coef=COEF``): mode
``delayed1+predict``, ``delayed4+dc:64``, ... (``none`` forces it off whatever the default).
Plain ``delayed1`` / ``delayed4`` run with the config's default rule.

The late loss is the mean training loss of the last 20 steps (``metrics.jsonl``); a 600-step run
also reports ``late_at_200``, the mean of its steps 180-199 (the cosine schedule still high there,
unlike a 200-step run's). A run that stops on a non-finite loss (exit status 1, ``train.nonfinite=stop``)
has ``late_loss`` null and its error line in ``stopped``. ``ratio`` is a delayed run's late loss over
exact's at the same space and steps.

A delayed run's training loss is that of the forward it trained, which read its shared ops
stale (or extrapolated); it is not the loss of the weights it leaves. ``--live K`` (default 24,
0: off) also scores the final supernet: ``search=random`` with one generation of K archs, which
the top-level seed makes the same K in every mode, each with its batch norm recalibrated on
training batches, on the validation split (the search's scoring). ``live_val_loss`` and
``live_val_acc`` are the means over the K archs; ``live_ratio`` is a delayed run's
``live_val_loss`` over exact's.

Spaces and sizes: ``conv``, ``cell`` and ``resmlp`` at their defaults, ``transformer`` at width 256
and 8 layers (the size the issue measured). Runs go one at a time with one thread each.

    python bench/late_loss.py [--spaces conv cell transformer resmlp] [--steps 200 600]
                              [--modes exact delayed1 delayed4] [--compensations predict dc:64]
                              [--seed 0] [--live 24] [--tag before] [-- extra overrides]

Prints one JSON line per run as it finishes, and writes them all to
``bench/out/late_loss[-<tag>].jsonl`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._spawn import OUT  # noqa: E402

LAST = 20  # steps the late loss averages
SPACES = {
    "conv": ["space=conv"],
    "cell": ["space=cell"],
    "transformer": ["space=transformer", "space.width=256", "space.layers=8"],
    "resmlp": ["space=resmlp"],
}
MODES = {
    "exact": ["pipeline.shared_ops=exact"],
    "delayed1": ["pipeline.shared_ops=delayed", "pipeline.shared_delay=1", "pipeline.window=4"],
    "delayed4": ["pipeline.shared_ops=delayed", "pipeline.shared_delay=4", "pipeline.window=4"],
    # the head (every space's last op, on the last stage) one update late, the other shared ops four
    "delayed4-head1": ["pipeline.shared_ops=delayed", "pipeline.shared_delay=4", "pipeline.window=4",
                       "pipeline.shared_delays={head:1}"],
}
# what every run shares: train only, FairNAS sampling, nothing recorded beyond the step metrics
COMMON = ["sampler=fair", "train.monitor_every=0", "train.tensorboard=false"]


def scoring(live: int) -> list[str]:
    """The search part of every run: none, or one generation of ``live`` random archs."""
    return ["search=random", f"search.population={live}", "search.generations=1"] if live else ["search=none"]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def mode_overrides(mode: str) -> list[str]:
    """``delayed1`` or ``delayed1+predict:0.5``: the base mode's overrides and the compensation's."""
    base, _, comp = mode.partition("+")
    out = list(MODES[base])
    if comp:
        rule, _, coef = comp.partition(":")
        out.append(f"pipeline.delay_compensation={rule}")
        if coef:
            out.append(f"pipeline.delay_compensation_coef={coef}")
    return out


def one_run(space: str, mode: str, steps: int, extra: list[str], live: int = 0) -> dict:
    """One ``python -m search`` run in a fresh directory; its figures as a JSON-able dict."""
    d = Path(tempfile.mkdtemp(prefix=f"pipenas-late-{space}-{mode.replace(':', '_')}-"))
    overrides = [*SPACES[space], *mode_overrides(mode), *COMMON, *scoring(live), f"train.steps={steps}", *extra]
    cmd = [sys.executable, "-m", "search", *overrides, f"output_dir={d}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    path = d / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r and r.get("nonfinite") is None}
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    row = {
        "space": space, "mode": mode, "steps": steps, "rc": proc.returncode,
        "late_loss": mean([losses[s] for s in range(steps - LAST, steps) if s in losses])
        if proc.returncode == 0 else None,
        "late_at_200": mean([losses[s] for s in range(200 - LAST, 200) if s in losses])
        if steps > 200 and proc.returncode == 0 else None,
        "steps_run": len(recs),
        "stopped": (errors[-1][:300] if errors else proc.stderr.strip().splitlines()[-1:] or None)
        if proc.returncode else None,
        "wall_s": round(wall, 1),
        "overrides": " ".join(overrides),
        **live_scores(d / "search-random.jsonl", live if proc.returncode == 0 else 0),
    }
    shutil.rmtree(d, ignore_errors=True)
    return row


def ratio(row: dict, exact: dict, key: str) -> float | None:
    """A delayed run's ``key`` over exact's (same space and steps), where both have one."""
    if row is exact or not exact.get(key) or row.get(key) is None:
        return None
    return row[key] / exact[key]


def live_scores(path: Path, live: int) -> dict:
    """The final supernet's mean validation loss and accuracy over the run's ``live`` scored
    archs (``search-random.jsonl``); nothing when not asked for or not all scored."""
    if not live:
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(rows) != live or any(r["val_loss"] is None for r in rows):
        return {"live_val_loss": None, "live_val_acc": None}
    return {"live_val_loss": mean([r["val_loss"] for r in rows]), "live_val_acc": mean([r["val_accuracy"] for r in rows])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spaces", nargs="+", default=list(SPACES), choices=list(SPACES))
    ap.add_argument("--steps", nargs="+", type=int, default=[200, 600])
    ap.add_argument("--modes", nargs="+", default=["exact", "delayed1", "delayed4"], choices=list(MODES))
    ap.add_argument("--compensations", nargs="*", default=[],
                    help="RULE[:COEF]: each delayed mode again with pipeline.delay_compensation=RULE")
    ap.add_argument("--seed", type=int, default=None, help="seed=... for every run (default: the config's)")
    ap.add_argument("--tag", default="", help="suffix of the output file (bench/out/late_loss-<tag>.jsonl)")
    ap.add_argument("--live", type=int, default=24, help="archs the final supernet is scored on (0: none)")
    ap.add_argument("extra", nargs="*", help="more overrides for every run (after --)")
    args = ap.parse_args()

    modes = [*args.modes, *(f"{m}+{c}" for m in args.modes if m != "exact" for c in args.compensations)]
    extra = [*([f"seed={args.seed}"] if args.seed is not None else []), *args.extra]
    rows: list[dict] = []
    for space in args.spaces:
        for steps in args.steps:
            exact: dict = {}
            for mode in modes:
                row = one_run(space, mode, steps, extra, args.live)
                if mode == "exact":
                    exact = row
                row["ratio"] = ratio(row, exact, "late_loss")
                if args.live:
                    row["live_ratio"] = ratio(row, exact, "live_val_loss")
                rows.append(row)
                print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    name = f"late_loss{'-' + args.tag if args.tag else ''}.jsonl"
    (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
