"""Issue 10: does the supernet rank architectures as stand-alone training does?

Space and budget: the ``cell`` space (2 stacked NAS-Bench-201 cells, 8 channels, 5^12 archs) on
digits. With the recipe below, stand-alone accuracies of non-degenerate archs spread from about
0.65 to 0.98 while two seeds of one arch differ by about 0.02-0.1: the spread is several times
the seed noise, so a ranking exists to be recovered. (The default ``conv`` space puts every arch
at 98-99 %, inside seed noise; a longer cell budget bunches archs at 96-98 % too.) Archs whose
cell output is identically zero (no path of non-``none`` edges from a cell's input to its
output) are left out: every method ranks them last at chance accuracy, and they would inflate
tau without saying anything about the supernet.

Ground truth: ``ARCHS`` archs stratified by parameter count (a seeded pool of random
non-degenerate archs sorted by parameters, cut into equal bins, one arch drawn per bin), each
trained from scratch with ``STANDALONE`` and ``SEEDS`` seeds by the app itself
(``search.app.run`` with the ``fixed`` sampler: the engine trains only that subnet, the same
training code path as supernet training) and scored like the search scores subnets (validation
accuracy, batch norm recalibrated). Results are cached in ``bench/out/ranking-cache/``, one
file per run, keyed by the sha256 of everything that decides it: the app's train digest (seed,
space, data, the arch, the recipe), the search settings that score it and torch's version.

Supernet: trained with ``SUPERNET`` (the same optimizer recipe, ``--supernet-steps`` steps) per
sampler, ``uniform`` and ``fair``; the archs are scored with inherited weights (BN
recalibrated). Per sampler: Kendall tau-b and Spearman rho of the supernet's accuracies against
the stand-alone mean; the ceiling, the mean seed-to-seed tau of the stand-alone runs; top-1 /
top-5 regret (best stand-alone mean of the set minus the best stand-alone mean among the
supernet's top 1 / top 5); and evolution against random search at the same budget on the
supernet (``--search-seeds`` searches each): each search's pick is trained stand-alone too, and
its regret is the best stand-alone mean of every arch trained here minus the pick's.

    python bench/ranking.py [--supernet-steps 1500] [--search-seeds 5] [--figure docs/ranking.png]
                            [--shared-ops exact delayed] [--shared-delay 1] [--delay-compensation predict]
                            [--supernet-seeds 20]

With several supernet seeds, a summary line per setting gives tau's mean with its 95 % interval
over the seeds (Student's t and a seeded bootstrap) beside the stand-alone ceiling, and with
exact and delayed together the paired difference delayed - exact per seed, with its interval.

Prints one JSON line per sampler (also written to ``bench/out/ranking.jsonl``).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")

from bench._spawn import OUT, emit, progress  # noqa: E402
from pipeline.settings import SHARED_MODES  # noqa: E402

ARCHS = 30
SEEDS = (0, 1, 2)
SPACE = {"_target_": "supernet.spaces.cell.build", "channels": 8, "cells": 2}
OPTIMIZER = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}
# Stand-alone recipe: 150 steps of 64 images (~6.7 epochs of digits' 1437), cosine, 5 warm-up.
STANDALONE = {"steps": 150, "batch_size": 64, "microbatches": 1, "optimizer": OPTIMIZER,
              "lr_schedule": "cosine", "warmup_steps": 5, "checkpoint_every": 0, "log_every": 1000}
SUPERNET = {**STANDALONE, "warmup_steps": 20}
SEARCH = {"population": 10, "generations": 5, "mutate_prob": 0.2, "crossover_prob": 0.5,
          "val_batch_size": 360, "bn_calib_batches": 4, "calib_batch_size": 64}
CACHE = OUT / "ranking-cache"
CACHE_FORMAT = 1


# -- rank statistics (small and exact; scipy.stats gives the same, checked in the tests) ----

def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either sequence accounted for)."""
    conc = disc = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            conc += 1
        else:
            disc += 1
    denom = math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))
    return (conc - disc) / denom if denom else float("nan")


def _ranks(v: Sequence[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman_rho(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho: Pearson's correlation of the (tie-averaged) ranks."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


# two-sided 95 % quantiles of Student's t by degrees of freedom (scipy is not a dependency)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 24: 2.064, 29: 2.045, 39: 2.023, 59: 2.001}


def t_interval(xs: Sequence[float]) -> tuple[float, float]:
    """The 95 % interval of the mean of ``xs`` (Student's t over independent draws: here the
    supernet seeds); (nan, nan) below two values."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan")
    df = n - 1
    t = _T975[max(k for k in _T975 if k <= df)]  # the next lower df: a slightly wider interval
    m, half = statistics.fmean(xs), t * statistics.stdev(xs) / math.sqrt(n)
    return m - half, m + half


def bootstrap_interval(xs: Sequence[float], rounds: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The 95 % percentile-bootstrap interval of the mean of ``xs`` (seeded resampling)."""
    if len(xs) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def top_k_regret(supernet: Sequence[float], truth: Sequence[float], k: int) -> float:
    """Best true score of the set minus the best true score among the supernet's top ``k``
    (ties in the supernet's scores broken by position, i.e. as the archs were drawn)."""
    top = sorted(range(len(supernet)), key=lambda i: (-supernet[i], i))[:k]
    return max(truth) - max(truth[i] for i in top)


# -- the archs ---------------------------------------------------------------------------

def _graph():
    from supernet.spaces import cell

    return cell.build(input_shape=(1, 8, 8), num_classes=10, channels=SPACE["channels"], cells=SPACE["cells"])


def degenerate(arch: Mapping[str, str], cells: int = SPACE["cells"]) -> bool:
    """Whether some cell's output is identically zero: no path of non-``none`` edges from the
    cell's input (node 0) to its output (node 3)."""
    for c in range(cells):
        reach = {0}
        for j in (1, 2, 3):
            if any(i in reach and arch[f"c{c}_e{j}_{i}"] != "none" for i in range(j)):
                reach.add(j)
        if 3 not in reach:
            return True
    return False


def stratified_archs(n: int, seed: int = 0, pool: int = 3000) -> list[dict[str, str]]:
    """``n`` distinct non-degenerate archs spread over the parameter range: a seeded pool sorted
    by parameters, cut into ``n`` equal bins, one arch drawn from each."""
    from search.evolution import SubnetCost

    graph = _graph()
    space, cost, rng = graph.space(), SubnetCost(graph, (1, 8, 8)), random.Random(seed)
    found = {}
    while len(found) < pool:
        arch = space.random(rng)
        if not degenerate(arch):
            found[arch] = cost.params(arch)
    ranked = sorted(found, key=lambda a: (found[a], a.to_json()))
    bins = [ranked[len(ranked) * i // n: len(ranked) * (i + 1) // n] for i in range(n)]
    return [dict(rng.choice(b)) for b in bins]


# -- runs of the app ---------------------------------------------------------------------

def _config(seed: int, train: Mapping[str, Any], sampler: Mapping[str, Any], search: Mapping[str, Any],
            pipeline: Mapping[str, Any] | None = None) -> dict:
    return {"seed": seed, "device": "cpu", "threads": 1, "output_dir": None, "resume": True,
            "space": dict(SPACE), "data": {"_target_": "search.data.Digits", "seed": seed, "val_fraction": 0.2,
                                           "split_seed": 0},
            "sampler": dict(sampler), "train": dict(train),
            "search": {"algorithm": "random", "top_k": 5, "constraints": {}, "seed_archs": [], **SEARCH, **search},
            "pipeline": dict(pipeline or {})}


def standalone(arch: Mapping[str, str], seed: int) -> dict[str, Any]:
    """Stand-alone validation accuracy of ``arch`` trained from scratch with ``seed``, cached."""
    import torch

    from search.app import run
    from search.config import train_digest

    # Scored as a search of two archs with ``arch`` first (the scoring the supernet gets).
    cfg = _config(seed, STANDALONE, {"name": "fixed", "arch": dict(arch)},
                  {"population": 2, "generations": 1, "top_k": 2, "seed_archs": [dict(arch)]})
    scoring = {k: cfg["search"][k] for k in ("val_batch_size", "bn_calib_batches", "calib_batch_size")}
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, train_digest(cfg), scoring, torch.__version__],
                                    sort_keys=True).encode()).hexdigest()[:24]
    path = CACHE / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="pipenas-ranking-") as tmp:
        summary = run(cfg, output_dir=tmp)
    entry = next(e for e in summary["top_k"] if e["arch"] == dict(arch))
    rec = {"arch": dict(arch), "seed": seed, "val_accuracy": entry["val_accuracy"], "val_loss": entry["val_loss"],
           "params": entry["params"], "flops": entry["flops"], "final_loss": summary["final_loss"],
           "train_time_s": summary["train_time_s"]}
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text(json.dumps(rec))
    os.replace(tmp_path, path)
    return rec


class Truth:
    """Stand-alone accuracies per arch and seed (trained on first use)."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.trained_s = 0.0

    def of(self, arch: Mapping[str, str]) -> list[float]:
        key = json.dumps(dict(arch), sort_keys=True)
        if key not in self.runs:
            recs = [standalone(arch, s) for s in SEEDS]
            self.trained_s += sum(r["train_time_s"] for r in recs)
            self.runs[key] = [r["val_accuracy"] for r in recs]
        return self.runs[key]

    def mean(self, arch: Mapping[str, str]) -> float:
        return statistics.fmean(self.of(arch))

    def best(self) -> float:
        return max(statistics.fmean(v) for v in self.runs.values())


def supernet_scores(sampler: str, steps: int, archs: list[dict[str, str]], search_seeds: int,
                    out: Path, pipeline: Mapping[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """Train one supernet with ``sampler`` (``pipeline``: how shared ops are read, one process
    runs the same semantics as the pipeline; ``seed``: the supernet's seed); score ``archs``
    with inherited weights; run evolution and random search ``search_seeds`` times each
    (resuming the trained supernet)."""
    from search.app import run

    train = {**SUPERNET, "steps": steps}
    t0 = time.perf_counter()
    first = run(_config(seed, train, {"name": sampler},
                        {"population": len(archs), "generations": 1, "top_k": len(archs), "seed_archs": archs},
                        pipeline), output_dir=out)
    acc = {json.dumps(e["arch"], sort_keys=True): e["val_accuracy"] for e in first["top_k"]}
    picks: dict[str, list[dict[str, Any]]] = {"evolution": [], "random": []}
    for s, algorithm in itertools.product(range(search_seeds), ("evolution", "random")):
        summary = run(_config(seed, train, {"name": sampler}, {"algorithm": algorithm, "seed": s}, pipeline),
                      output_dir=out)
        assert summary["resumed_from_step"] == steps  # only searched, on the same supernet
        picks[algorithm].append({"arch": summary["best"]["arch"], "supernet_accuracy": summary["best"]["val_accuracy"],
                                 "evaluated": summary["search"]["evaluated"]})
    return {"accuracy": [acc[json.dumps(a, sort_keys=True)] for a in archs], "picks": picks,
            "train_time_s": first["train_time_s"], "time_s": time.perf_counter() - t0,
            "final_loss": first["final_loss"]}


# -- the benchmark -----------------------------------------------------------------------

def figures(path: Path, archs: list[dict[str, str]], truth: Truth, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (sampler, r) in zip(axes, results.items()):
        runs = [truth.of(a) for a in archs]
        mean = [statistics.fmean(v) for v in runs]
        lo = [m - min(v) for m, v in zip(mean, runs)]
        hi = [max(v) - m for m, v in zip(mean, runs)]
        ax.errorbar(r["accuracy"], mean, yerr=[lo, hi], fmt="o", ms=4, capsize=2, alpha=0.8,
                    label=f"{len(archs)} archs (bars: seed min-max)")
        ax.set_title(f"{sampler} sampler: tau {r['row']['kendall_tau']:.2f}, rho {r['row']['spearman_rho']:.2f}\n"
                     f"(seed-to-seed tau ceiling {r['row']['ceiling_tau']:.2f})")
        ax.set_xlabel("supernet accuracy, inherited weights")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel(f"stand-alone accuracy (mean of {len(SEEDS)} seeds)")
    fig.suptitle("Ranking quality on the cell space (digits validation)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_or_none(xs: Sequence[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--supernet-steps", type=int, default=1500)
    ap.add_argument("--search-seeds", type=int, default=5)
    ap.add_argument("--archs", type=int, default=ARCHS)
    ap.add_argument("--samplers", nargs="+", default=["uniform", "fair"])
    ap.add_argument("--figure", type=Path, default=OUT / "ranking.png")
    ap.add_argument("--shared-ops", nargs="+", default=["exact"], choices=SHARED_MODES,
                    help="how ops in every subnet are trained (issue 15: delayed reads vs exact); one row each")
    ap.add_argument("--shared-delay", type=int, default=1)
    ap.add_argument("--supernet-seeds", type=int, default=1, help="supernets per setting: tau's noise")
    ap.add_argument("--delay-compensation", default=None, metavar="RULE[:COEF]",
                    help="pipeline.delay_compensation for the delayed rows (default: the config's default)")
    args = ap.parse_args()
    rule, _, coef = (args.delay_compensation or "").partition(":")
    if args.delay_compensation:
        compensation = (rule, float(coef) if coef else 1.0)
    else:
        from pipeline import PipelineSettings

        default = PipelineSettings()
        compensation = (default.delay_compensation, default.delay_compensation_coef)

    import logging

    logging.disable(logging.INFO)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    archs = stratified_archs(args.archs)
    truth = Truth()
    progress(f"ranking: stand-alone ground truth, {len(archs)} archs x {len(SEEDS)} seeds (cached in {CACHE})")
    for i, a in enumerate(archs):
        truth.of(a)
        if (i + 1) % 10 == 0:
            progress(f"  {i + 1}/{len(archs)} archs")
    sa = [truth.mean(a) for a in archs]
    per_seed = [[truth.of(a)[k] for a in archs] for k in range(len(SEEDS))]
    pairs = [kendall_tau(per_seed[i], per_seed[j]) for i, j in itertools.combinations(range(len(SEEDS)), 2)]
    top = [k for k, y in enumerate(sa) if y >= statistics.median(sa)]  # the better half, by stand-alone mean
    pairs_top = [kendall_tau([per_seed[i][k] for k in top], [per_seed[j][k] for k in top])
                 for i, j in itertools.combinations(range(len(SEEDS)), 2)]

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pipenas-ranking-supernet-") as tmp:
        for sampler, mode, seed in itertools.product(args.samplers, args.shared_ops, range(args.supernet_seeds)):
            pipe = {"shared_ops": mode, "shared_delay": args.shared_delay,
                    **({"delay_compensation": compensation[0], "delay_compensation_coef": compensation[1]}
                       if args.delay_compensation else {})}
            label = sampler if (len(args.shared_ops), args.supernet_seeds) == (1, 1) else f"{sampler}/{mode}/seed{seed}"
            progress(f"ranking: supernet {label}, {args.supernet_steps} steps, "
                     f"then {args.search_seeds} evolution and random searches")
            results[label] = supernet_scores(sampler, args.supernet_steps, archs, args.search_seeds,
                                             Path(tmp) / label.replace("/", "-"), pipe, seed)
            results[label].update(sampler=sampler, shared_ops=mode, supernet_seed=seed)
    for r in results.values():  # every search's pick trained stand-alone (before the best is taken)
        for p in itertools.chain(*r["picks"].values()):
            p["standalone_accuracy"] = truth.mean(p["arch"])
    best = truth.best()
    rows = []
    for r in results.values():
        regret = {alg: [best - p["standalone_accuracy"] for p in picks] for alg, picks in r["picks"].items()}
        row = {
            "bench": "ranking", "sampler": r["sampler"], "shared_ops": r["shared_ops"],
            "shared_delay": args.shared_delay if r["shared_ops"] == "delayed" else None,
            "delay_compensation": list(compensation) if r["shared_ops"] == "delayed" else None,
            "supernet_seed": r["supernet_seed"], "space": SPACE, "archs": len(archs), "seeds": len(SEEDS),
            "standalone_steps": STANDALONE["steps"], "supernet_steps": args.supernet_steps,
            "kendall_tau": round(kendall_tau(r["accuracy"], sa), 4),
            "spearman_rho": round(spearman_rho(r["accuracy"], sa), 4),
            "ceiling_tau": round(statistics.fmean(pairs), 4), "ceiling_tau_pairs": [round(t, 4) for t in pairs],
            # the same among the better half of the archs: the ones a search is after
            "kendall_tau_top_half": round(kendall_tau([r["accuracy"][k] for k in top], [sa[k] for k in top]), 4),
            "ceiling_tau_top_half": round(statistics.fmean(pairs_top), 4),
            "top1_regret": round(top_k_regret(r["accuracy"], sa, 1), 4),
            "top5_regret": round(top_k_regret(r["accuracy"], sa, 5), 4),
            "standalone_range": [round(min(sa), 4), round(max(sa), 4)],
            "seed_spread_median": round(statistics.median(max(truth.of(a)) - min(truth.of(a)) for a in archs), 4),
            "supernet_range": [round(min(r["accuracy"]), 4), round(max(r["accuracy"]), 4)],
            "search_budget": SEARCH["population"] * SEARCH["generations"], "search_runs": args.search_seeds,
            "evolution_regret_mean": _mean_or_none(regret["evolution"]),
            "random_regret_mean": _mean_or_none(regret["random"]),
            "evolution_regret": [round(x, 4) for x in regret["evolution"]],
            "random_regret": [round(x, 4) for x in regret["random"]],
            "regret_reference": round(best, 4), "standalone_archs_trained": len(truth.runs),
            "supernet_final_loss": r["final_loss"], "supernet_train_s": r["train_time_s"],
            "supernet_accuracy": r["accuracy"], "standalone_mean": [round(x, 4) for x in sa],
        }
        r["row"] = row
        rows.append(row)
    if args.supernet_seeds > 1 or len(args.shared_ops) > 1:  # tau per setting over supernet seeds: its noise
        by_setting: dict[tuple, list[float]] = {}
        for row in rows:
            by_setting.setdefault((row["sampler"], row["shared_ops"]), []).append(row["kendall_tau"])
        summaries = []
        for (sampler, mode), taus in by_setting.items():
            lo, hi = t_interval(taus)
            blo, bhi = bootstrap_interval(taus)
            summaries.append({
                "bench": "ranking", "summary": True, "sampler": sampler, "shared_ops": mode,
                "shared_delay": args.shared_delay if mode == "delayed" else None,
                "delay_compensation": compensation if mode == "delayed" else None,
                "archs": len(archs), "supernet_seeds": len(taus), "supernet_steps": args.supernet_steps,
                "kendall_tau_mean": round(statistics.fmean(taus), 4),
                "kendall_tau_sd": round(statistics.stdev(taus), 4) if len(taus) > 1 else None,
                "kendall_tau_ci95_t": [round(lo, 4), round(hi, 4)], "ci95_width_t": round(hi - lo, 4),
                "kendall_tau_ci95_bootstrap": [round(blo, 4), round(bhi, 4)], "ci95_width_bootstrap": round(bhi - blo, 4),
                "ceiling_tau": rows[0]["ceiling_tau"], "ceiling_tau_pairs": rows[0]["ceiling_tau_pairs"],
                "kendall_tau_seeds": taus, "kendall_tau_range": [min(taus), max(taus)]})
        # delayed minus exact on the same supernet seed (same archs, data and subnet stream): paired
        for sampler in args.samplers:
            ex, de = by_setting.get((sampler, "exact")), by_setting.get((sampler, "delayed"))
            if ex and de and len(ex) == len(de) > 1:
                diff = [d - e for d, e in zip(de, ex)]
                lo, hi = t_interval(diff)
                summaries.append({"bench": "ranking", "summary": True, "paired": "delayed - exact", "sampler": sampler,
                                  "supernet_seeds": len(diff), "tau_difference_mean": round(statistics.fmean(diff), 4),
                                  "tau_difference_ci95_t": [round(lo, 4), round(hi, 4)],
                                  "ci95_width_t": round(hi - lo, 4)})
        rows += summaries
    rows[-1]["wall_s"] = round(time.perf_counter() - t_start, 1)
    rows[-1]["cpu_s"] = round(time.process_time() - cpu_start, 1)
    rows[-1]["loadavg"] = round(os.getloadavg()[0], 2)
    emit("ranking", rows)
    figures(args.figure, archs, truth, {k: r for k, r in results.items() if r["supernet_seed"] == 0})  # one panel a setting
    progress(f"ranking: figure {args.figure}")


if __name__ == "__main__":
    main()
