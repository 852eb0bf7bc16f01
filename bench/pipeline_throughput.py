"""Issue 3: measured CPU throughput of a real 2-stage gloo pipeline against the single-process reference.

The same work in every run: the transformer space (8 layers, width 256, candidates attn2, ffn2,
conv3, identity), batches of 32 samples of 32 tokens x 32 features, the same arch stream
(random.Random(seed)) and the same data, SGD. Pipelined: PipelineEngine in 2 spawned gloo
processes, one intra-op thread each, planner dynamic (eps 0.05) on the measured profile
(pipeline.profile.shared_profile), link settings from the fitted gloo loopback. Baselines, in
the same invocation: ReferenceEngine with 1 thread (the same core count per stage) and with 2
threads (the whole 2-core machine, as the 2 stages use it), run by rank 0 right after each
pipelined step while rank 1 idles in a barrier, so that pipeline and baselines see the same
machine load. The machine is shared with other jobs: the load average is recorded, and
``contention`` (compute wall time per CPU second) marks the steps that ran undisturbed
(<= 1.10: "quiet").

Per setting (schedule in {gpipe, 1f1b} x M in {2, 4, 8}): samples/s = batch / median step time
over the steps after --warmup (pipelined step time: the slowest rank's wall time of the step),
and the measured bubble fraction 1 - sum_r busy_s / (P * step wall) per step (median) against
the analytic (P - 1) / (M + P - 1). The step losses are compared with the reference's (the
pipeline must compute the same numbers).

    python bench/pipeline_throughput.py [--steps 10] [--warmup 2]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import (  # noqa: E402
    QUIET, contention, emit, measure_link, measured_step, progress, spawn,
)

SPACE = dict(layers=8, width=256, candidates=["attn2", "ffn2", "conv3", "identity"])
SAMPLE = (32, 32)
BATCH = 32
P = 2


def _graph():
    from supernet.spaces import build_space

    return build_space("transformer", input_shape=SAMPLE, num_classes=10, **SPACE)


def _data(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(BATCH, *SAMPLE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _optim():
    from pipeline import LrSchedule, OptimConfig

    optim = OptimConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
    return optim, LrSchedule(optim.lr, 1000)


def worker(spec: dict, rank: int, world: int) -> dict:
    """Each rank: every setting in turn; per step the (wall, busy) of every rank, then (rank 0
    only, the other rank idle in a barrier) one step of each reference, so that the pipeline
    and its baselines are measured moments apart under the same machine load."""
    import torch.distributed as dist

    from pipeline import DistEnv, PipelineSettings, ReferenceEngine
    from pipeline.profile import shared_profile
    from pipeline.runtime import PipelineEngine

    latency, bandwidth = measure_link(rank)
    graph = _graph()
    archs = [graph.space().random(rng) for rng in [random.Random(spec["seed"])] for _ in range(spec["steps"])]
    optim, lr = _optim()
    out = {"link": {"latency_s": latency, "bandwidth": bandwidth}, "settings": []}
    profiles = {}
    for schedule, M in spec["settings"]:
        if M not in profiles:  # one profile per micro-batch size, shared by both schedules
            profiles[M] = shared_profile(graph, SAMPLE, BATCH // M, "sgd", rank, world, "cpu", repeats=15,
                                         use_cache=spec["cached_profile"])
        costs = profiles[M]
        settings = PipelineSettings(schedule=schedule, planner="dynamic", eps=0.05, timeout_s=120.0,
                                    link_bandwidth=bandwidth, link_latency_s=latency)
        engine = PipelineEngine(graph, spec["seed"], optim, M, lr, settings, DistEnv(rank, world, rank),
                                torch.device("cpu"), costs=costs)
        refs = {th: ReferenceEngine(graph, spec["seed"], optim, M, lr, "cpu") for th in (1, 2)} if rank == 0 else {}
        steps = []
        for step, arch in enumerate(archs):
            x, y = _data(spec["seed"], step)
            r, ranks = measured_step(engine, step, arch, x, y, archs[step + 1 : step + 3])
            row = {"loss": r.loss, "ranks": ranks}
            for th, ref in refs.items():
                torch.set_num_threads(th)
                t0 = time.perf_counter()
                c0 = time.process_time()
                rr = ref.train_step(step, arch, x, y)
                row[f"ref{th}"] = (time.perf_counter() - t0, rr.loss, time.process_time() - c0)
                torch.set_num_threads(1)
            dist.barrier()
            steps.append(row)
        out["settings"].append({"schedule": schedule, "M": M, "steps": steps})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per setting, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--cached-profile", action="store_true",
                    help="reuse a cached profile (default: measure afresh, under this run's machine load)")
    args = ap.parse_args()
    settings = [(s, M) for s in ("gpipe", "1f1b") for M in args.microbatches]
    spec = {"seed": args.seed, "steps": args.steps, "settings": settings, "threads": 1, "timeout_s": 600,
            "cached_profile": args.cached_profile}
    progress(f"pipelined: {P} gloo ranks, {len(settings)} settings x {args.steps} steps ...")
    t0 = time.perf_counter()
    piped = spawn(P, "bench.pipeline_throughput:worker", spec, timeout_s=900)
    progress(f"pipelined done in {time.perf_counter() - t0:.1f} s; link {piped['link']}")
    rows = []
    w = args.warmup
    for res in piped["settings"]:
        M, steps = res["M"], res["steps"][w:]
        walls = [max(r["wall_s"] for r in s["ranks"]) for s in steps]
        bubbles = [1 - sum(r["busy_s"] for r in s["ranks"]) / (P * max(r["wall_s"] for r in s["ranks"])) for s in steps]
        step_pipe = statistics.median(walls)
        ref1, ref2 = (statistics.median(s[f"ref{th}"][0] for s in steps) for th in (1, 2))
        paired1 = statistics.median(s["ref1"][0] / wall for s, wall in zip(steps, walls))
        cont = [contention(sum(r["busy_s"] for r in s["ranks"]), sum(r["cpu_s"] for r in s["ranks"])) for s in steps]
        ref_cont = [contention(s["ref1"][0], s["ref1"][2]) for s in steps]
        quiet = [s for s, c, rc in zip(steps, cont, ref_cont) if c <= QUIET and rc <= QUIET]
        quiet_pipe = [max(r["wall_s"] for r in s["ranks"]) for s in quiet]
        match1 = all(s["loss"] == s["ref1"][1] for s in res["steps"])
        match2 = all(s["loss"] == s["ref2"][1] for s in res["steps"])
        rows.append({
            "bench": "pipeline_throughput", "P": P, "schedule": res["schedule"], "M": M, "batch": BATCH,
            "space": dict(SPACE, name="transformer", sample=list(SAMPLE)), "steps_measured": len(steps),
            "pipeline_samples_per_s": BATCH / step_pipe,
            "reference_1thread_samples_per_s": BATCH / ref1,
            "reference_2threads_samples_per_s": BATCH / ref2,
            "speedup_vs_reference_1thread": ref1 / step_pipe,
            "speedup_vs_reference_2threads": ref2 / step_pipe,
            "speedup_vs_reference_1thread_paired_median": paired1,
            "busy_sum_over_reference_1thread": statistics.median(
                sum(r["busy_s"] for r in s["ranks"]) / s["ref1"][0] for s in steps),
            "contention_median": statistics.median(cont), "reference_contention_median": statistics.median(ref_cont),
            "quiet_steps": len(quiet),
            "quiet_speedup_vs_reference_1thread": (statistics.median(s["ref1"][0] for s in quiet)
                                                   / statistics.median(quiet_pipe)) if quiet else None,
            "quiet_bubble_measured_median": statistics.median(
                1 - sum(r["busy_s"] for r in s["ranks"]) / (P * max(r["wall_s"] for r in s["ranks"])) for s in quiet) if quiet else None,
            "bubble_measured_median": statistics.median(bubbles),
            "bubble_measured_without_migration_median": statistics.median(
                1 - sum(r["busy_s"] for r in s["ranks"]) / (P * (max(r["wall_s"] for r in s["ranks"]) - max(r["migration_s"] for r in s["ranks"])))
                for s in steps),
            "migration_ms_mean": 1e3 * statistics.fmean(max(r["migration_s"] for r in s["ranks"]) for s in steps),
            "bubble_analytic": (P - 1) / (M + P - 1),
            # the bubble a perfectly balanced split would still have is the analytic one; the rest
            # comes from stage imbalance and per-step work outside busy_s (plan, migrate, waits)
            "busy_imbalance_median": statistics.median(
                max(r["busy_s"] for r in s["ranks"]) / (sum(r["busy_s"] for r in s["ranks"]) / P) for s in steps),
            "max_in_flight": [r["max_in_flight"] for r in steps[-1]["ranks"]],
            "migrated_ops_per_step": statistics.fmean(s["ranks"][0]["migrated_ops"] for s in steps),
            "losses_match_reference_1thread": match1, "losses_match_reference_2threads": match2,
            "link": piped["link"], "cores": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "baseline": "ReferenceEngine, 1 process, same space/steps/batch/M/archs, 1 and 2 threads, same run",
        })
    emit("pipeline_throughput", rows)


if __name__ == "__main__":
    main()
