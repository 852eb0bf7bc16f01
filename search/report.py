"""Plots of a finished run: ``python -m search.report <run dir> [--out DIR]``.

Reads what the run wrote (``metrics.jsonl``, ``summary.json``, ``search-<algorithm>.jsonl``,
``trace.json``) and writes PNGs beside them (or into ``--out``):

- ``loss_lr.png``: training loss per step (and its running mean), learning rate; non-finite
  steps marked.
- ``throughput.png``: samples/s per step.
- ``migration.png``: bytes of ops migrated between pipeline stages per step.
- ``search_progress.png``: best validation accuracy so far against archs evaluated, one line per
  search that ran in this directory (evolution, and the random baseline when it ran too: a
  finished run run again with ``search=random`` only searches), generations marked. Both start
  from the same seeded draws: the baseline is thin, dashed and drawn over evolution's wide solid
  line, with other markers, so both show where they coincide (a note says over how many archs).
- ``pareto.png``: validation accuracy against parameters and against FLOPs of every evaluated
  arch, Pareto front marked (FLOPs counted here, on the meta device, for the space in
  ``summary.json``).
- ``stages.png`` (a run with ``trace.json``): each rank's busy time and bubble per traced step.

Needs matplotlib (``pip install 'pipenas[report]'``); uses its Agg backend (no display).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ReportError", "report", "pareto_front", "main"]

log = logging.getLogger(__name__)


class ReportError(ValueError):
    """The directory is not a run directory, or matplotlib is missing."""


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError("search.report needs matplotlib: pip install 'pipenas[report]' (or matplotlib>=3.7)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return out


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (lower or equal cost and higher or equal
    accuracy, one of them strictly), sorted by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _running_mean(values: list[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


# -- the figures -------------------------------------------------------------------------

def _loss_lr(plt: Any, metrics: list[dict], path: Path) -> None:
    steps = [m["step"] for m in metrics]
    fin = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None]
    bad = [m["step"] for m in metrics if m.get("loss") is None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if fin:
        xs, ys = zip(*fin)
        ax.plot(xs, ys, ".", ms=2, alpha=0.35, color="tab:blue", label="loss per step")
        window = max(1, len(ys) // 30)
        ax.plot(xs, _running_mean(list(ys), window), color="tab:blue", label=f"running mean ({window} steps)")
    for i, s in enumerate(bad):
        ax.axvline(s, color="tab:red", alpha=0.6, lw=1, label="non-finite loss" if i == 0 else None)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy, batch mean)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(steps, [m["lr"] for m in metrics], color="tab:orange", label="learning rate")
    ax2.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title("Supernet training: loss and learning rate per step")
    _save(fig, path)


def _per_step(plt: Any, metrics: list[dict], key: str, ylabel: str, title: str, path: Path, scale: float = 1.0,
              note: str = "") -> None:
    pts = [(m["step"], m[key] / scale) for m in metrics if m.get(key) is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, ".", ms=3, alpha=0.5, label="per step")
        window = max(1, len(ys) // 30)
        ax.plot(xs, _running_mean(list(ys), window), label=f"running mean ({window} steps)")
        ax.legend(loc="best", fontsize=8)
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    _save(fig, path)


# Each search's line. Evolution and its random baseline start from the same seeded draws, so their
# lines coincide at first (often for a whole generation): the baseline is drawn thin, dashed, in
# another colour and over evolution's wide solid line, so both show where they coincide.
_SEARCH_STYLE = {
    "evolution": {"color": "tab:blue", "ls": "-", "lw": 3.0, "zorder": 2, "marker": "o", "ms": 6},
    "random": {"color": "tab:orange", "ls": (0, (4, 2)), "lw": 1.5, "zorder": 3, "marker": "x", "ms": 7, "mew": 1.5},
}


def _search_progress(plt: Any, logs: dict[str, list[dict]], population: int | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    curves = {}
    for algorithm, entries in sorted(logs.items()):
        best, ys = -math.inf, []
        for e in entries:
            if not e.get("nonfinite") and e["val_accuracy"] is not None:
                best = max(best, e["val_accuracy"])
            ys.append(best if best > -math.inf else math.nan)
        curves[algorithm] = ys
        # marked at the end of each generation (random search: each population-sized batch of draws)
        ends = [i for i, e in enumerate(entries[:-1]) if entries[i + 1]["generation"] != e["generation"]]
        ax.step(range(1, len(ys) + 1), ys, where="post", label=f"{algorithm} (best {best:.4f})", markevery=ends,
                **_SEARCH_STYLE.get(algorithm, {}))
    note = None
    if len(curves) > 1:
        a, b = (curves[k] for k in sorted(curves)[:2])
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if same:
            note = f"the lines coincide over the first {same} archs\n(both start from the same seeded draws)"
    ax.set_xlabel("architectures evaluated (inherited weights)")
    ax.set_ylabel("best validation accuracy so far")
    notes = [f"population {population}"] if population else []
    ax.set_title(f"Search progress ({'; '.join([*notes, 'markers: the end of each generation'])})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, title=note, title_fontsize=8)
    _save(fig, path)


def _pareto(plt: Any, archs: list[dict], flops: list[int | None], path: Path) -> None:
    panels = [("params", [a["params"] for a in archs], "parameters")]
    if any(f is not None for f in flops):
        panels.append(("flops", flops, "forward FLOPs per sample"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (_, cost, label) in zip(axes[0], panels):
        pts = [(c, a["val_accuracy"]) for c, a in zip(cost, archs) if c is not None and not a.get("nonfinite")]
        if pts:
            ax.scatter(*zip(*pts), s=14, alpha=0.5, label=f"{len(pts)} evaluated archs")
            front = [pts[i] for i in pareto_front(pts)]
            ax.step(*zip(*front), where="post", color="tab:red", lw=1.2)
            ax.plot(*zip(*front), "o", color="tab:red", ms=5, label=f"Pareto front ({len(front)})")
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (log scale)")
        ax.set_ylabel("validation accuracy (inherited weights)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"Accuracy vs {label}")
    _save(fig, path)


def _stages(plt: Any, trace: dict, path: Path) -> None:
    from pipeline.trace import busy_and_bubble, spans_from_chrome

    table = busy_and_bubble(spans_from_chrome(trace))
    ranks = sorted({r for per in table.values() for r in per})
    steps = sorted(table)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(steps) * len(ranks)), 4.5))
    width = 0.8 / max(1, len(ranks))
    for k, r in enumerate(ranks):
        xs = [i + (k - (len(ranks) - 1) / 2) * width for i in range(len(steps))]
        busy = [table[s].get(r, (0, 0, 0))[0] * 1e3 for s in steps]
        bubble = [table[s].get(r, (0, 0, 0))[1] * 1e3 for s in steps]
        ax.bar(xs, busy, width, label=f"rank {r} busy", color=f"C{k}")
        ax.bar(xs, bubble, width, bottom=busy, label=f"rank {r} bubble", color=f"C{k}", alpha=0.3, hatch="//")
    ax.set_xticks(range(len(steps)), [f"step {s}" for s in steps])
    ax.set_ylabel("time in the step (ms)")
    ax.set_title("Pipeline stages per traced step\nbusy: forward, backward, optimizer; bubble: the rest of the step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: short bars stay visible
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


# -- the report --------------------------------------------------------------------------

def _flops(summary: dict, archs: list[dict]) -> list[int | None]:
    """FLOPs per sample of ``archs``, counted for the space named in the summary (``None``
    each when the space cannot be rebuilt here, e.g. a custom space not on the path)."""
    try:
        from search.config import TargetConfig, build_space
        from search.evolution import SubnetCost
        from supernet import Arch

        space, data = summary["space"], summary["data"]
        graph = build_space(TargetConfig("space", space["target"], dict(space["options"])), data["input_shape"],
                            data["num_classes"])
        cost = SubnetCost(graph, data["input_shape"])
        return [cost.flops(Arch(a["arch"])) for a in archs]
    except Exception as e:  # the FLOPs panel is optional; params come from the run itself
        log.warning("cannot count FLOPs for this run's space (%s: %s); plotting parameters only", type(e).__name__, e)
        return [None] * len(archs)


def report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the run's PNGs; returns their paths."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise ReportError(f"{run_dir}: no metrics.jsonl; expected the run directory of a `python -m search` run")
    plt = _plt()
    out = Path(out) if out is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    metrics = _jsonl(metrics_path)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    written = []

    def path(name: str) -> Path:
        written.append(out / name)
        return out / name

    _loss_lr(plt, metrics, path("loss_lr.png"))
    _per_step(plt, metrics, "samples_per_s", "samples / s", "Training throughput per step", path("throughput.png"))
    moved = any(m.get("migrated_bytes") for m in metrics)
    _per_step(plt, metrics, "migrated_bytes", "migrated (KiB)", "Ops migrated between pipeline stages per step",
              path("migration.png"), scale=1024.0,
              note="" if moved else "no op migrated (one process, or a stable partition)")

    logs = {p.stem.removeprefix("search-"): _jsonl(p) for p in sorted(run_dir.glob("search-*.jsonl"))}
    logs = {k: v for k, v in logs.items() if v}
    if logs:
        population = (logs.get("evolution") or next(iter(logs.values())))
        per_gen = sum(1 for e in population if e["generation"] == 0)
        _search_progress(plt, logs, per_gen, path("search_progress.png"))
        archs = list({json.dumps(e["arch"], sort_keys=True): e for v in logs.values() for e in v}.values())
        _pareto(plt, archs, _flops(summary, archs), path("pareto.png"))
    else:
        log.warning("%s: no search-*.jsonl (the run did not finish its search); no search plots", run_dir)
    if (run_dir / "trace.json").exists():
        _stages(plt, json.loads((run_dir / "trace.json").read_text()), path("stages.png"))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m search.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (metrics.jsonl, summary.json, ...)")
    ap.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default: the run directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        for p in report(args.run_dir, args.out):
            print(p)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
