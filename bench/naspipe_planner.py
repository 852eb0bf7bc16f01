"""Issue 4: dynamic vs static vs oracle partitioning on NASPipe's space, simulated.

NASPipe's transformer space (48 choice layers x 24 candidates) under two cost sources:

* ``measured``: the measured profiler (pipeline.profile) on this machine's CPU, one thread,
  at width 256, micro-batches of 4 sequences of 16 tokens (input features 32), SGD; link: the
  gloo loopback between two spawned processes, fitted as latency + bytes / bandwidth.
* ``analytic``: pipeline.plan.costs.analytic_costs at NASPipe's width 1024, micro-batches of 8
  sequences of 128 tokens (input features 64), SGD, with GPU-like rates (1e14 FLOP/s,
  2e12 B/s, 10 us per op); link: NVLink-like 100 GB/s, 10 us.

For every (source, P in {4, 8}, M in {8, 16}) and planner (dynamic with --eps, static from the
supernet's mean costs, oracle) it walks the same stream of --subnets uniformly sampled subnets,
tracking op owners across subnets exactly as the runtime does (initial_owners, moves), and per
subnet: plans (timed), simulates the 1F1B step (pipeline.plan.simulate: per-stage fwd/bwd sums,
send = latency + cut bytes / bandwidth) and adds the migration the step waits for, as the
runtime migrates (pipeline.plan.planners.migration_wait): an op the previous subnet used moves after
that step (moved bytes / bandwidth + latency per op, on the critical path); the others move
during the previous step and count only by what exceeds its duration. The oracle pays none by
definition. ``dynamic_all_wait`` is the same planner told nothing about the previous subnet and
charged for every move in full (a runtime without early migration); every planner's figures are
also given that way (``subnets_per_hour_all_moves_wait``). One JSON line per setting.

    python bench/naspipe_planner.py [--subnets 1000] [--eps 0.05] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import emit, progress, spawn  # noqa: E402
from pipeline.plan.costs import CostTable, analytic_costs, mean_problem, subnet_problem  # noqa: E402
from pipeline.plan.planners import DynamicPlanner, OraclePlanner, StaticPlanner, migration_wait, predicted_step  # noqa: E402
from pipeline.plan.placement import initial_owners, moves  # noqa: E402
from pipeline.profile import measured_costs  # noqa: E402
from pipeline.plan.schedule import build as build_schedule  # noqa: E402
from supernet.spaces import transformer  # noqa: E402

SOURCES = {
    "measured": dict(width=256, microbatch=4, sample_shape=(16, 32)),
    "analytic": dict(width=1024, microbatch=8, sample_shape=(128, 64),
                     rates=dict(flops_per_s=1e14, bytes_per_s=2e12, overhead_s=1e-5),
                     link=dict(latency_s=1e-5, bandwidth=100e9)),
}
SCHEDULE = "1f1b"


def layer_cost_cv(graph, table: CostTable) -> dict:
    """Coefficient of variation of fwd+bwd over one layer's 24 candidates (and of param bytes)."""
    layer = [s for s in graph.slots() if s.node == "layer00"]
    t = np.array([table.ops[s.op_id].fwd + table.ops[s.op_id].bwd for s in layer])
    p = np.array([table.ops[s.op_id].param_bytes for s in layer], dtype=float)
    return {"time_cv": float(t.std() / t.mean()), "time_min_ms": float(t.min() * 1e3),
            "time_max_ms": float(t.max() * 1e3), "param_bytes_cv": float(p.std() / p.mean())}


def run_setting(graph, table, archs, P, M, link, eps, extra_eps=(), objective="step") -> dict:
    schedule = build_schedule(SCHEDULE, P, M)
    kw = dict(num_stages=P, num_microbatches=M, schedule=SCHEDULE, bandwidth=link["bandwidth"],
              latency=link["latency_s"])
    planners = {"dynamic": DynamicPlanner(eps, objective=objective),
                "dynamic_all_wait": DynamicPlanner(eps, objective=objective),
                "static": StaticPlanner.from_problem(mean_problem(graph, table, **kw)), "oracle": OraclePlanner(),
                **({"dynamic_minmax": DynamicPlanner(eps)} if objective == "step" else {}),
                **{f"dynamic_eps{e:g}": DynamicPlanner(e) for e in extra_eps}}
    actives = [graph.active_ops(a) for a in archs]
    problems = [subnet_problem(graph, act, table, P, M, SCHEDULE, link["bandwidth"], link["latency_s"])
                for act in actives]
    out: dict = {}
    for name, planner in planners.items():
        # "dynamic_all_wait": the same planner told nothing about the step before, charged as if
        # every move waited for it (the runtime without early migration)
        early = name != "dynamic_all_wait"
        owners = initial_owners(graph.slots(), P)
        total = total_all_wait = compute_total = moved_total = waited_total = 0.0
        imb, plan_ms, balance, stage_sum = [], [], [], []
        before: frozenset | None = None
        previous_step = 0.0
        for act, prob in zip(actives, problems):
            previous = {op.op_id: owners[op.op_id] for op in act}
            t0 = time.perf_counter()
            part = planner.plan(prob, previous, before if early else None)
            plan_ms.append((time.perf_counter() - t0) * 1e3)
            todo = moves(act, part.bounds, owners)
            for mv in todo:
                owners[mv.op_id] = mv.dst
            step = predicted_step(prob, part, 0.0, schedule)  # the 1F1B schedule replayed, no migration
            # as the runtime migrates: ops the step before used move after it, the others during it
            size = {op.op_id: op.param_bytes + op.optim_bytes for op in prob.ops}
            waiting = [mv for mv in todo if before is None or not early or mv.op_id in before]
            busy_bytes = sum(size[mv.op_id] for mv in waiting)
            if name == "oracle":
                migration = all_wait = 0.0
            else:
                migration = migration_wait(part.moved_bytes, len(todo), busy_bytes, len(waiting),
                                           link["bandwidth"], link["latency_s"], window=previous_step)
                all_wait = part.moved_bytes / link["bandwidth"] + len(todo) * link["latency_s"]
            total += step + migration
            total_all_wait += step + all_wait
            compute_total += step
            moved_total += part.moved_bytes
            waited_total += busy_bytes if name != "oracle" else 0
            st = part.stage_times
            imb.append(max(st) / (sum(st) / P))
            balance.append(part.max_time)
            stage_sum.append(sum(st))
            before, previous_step = frozenset(op.op_id for op in act), step
        n = len(archs)
        out[name] = {
            "subnets_per_hour": 3600.0 * n / total,
            "subnets_per_hour_all_moves_wait": 3600.0 * n / total_all_wait,
            "subnets_per_hour_no_migration": 3600.0 * n / compute_total,
            "imbalance_median": statistics.median(imb), "imbalance_worst": max(imb),
            "migrated_bytes_per_subnet": moved_total / n,
            "migrated_bytes_per_subnet_on_critical_path": waited_total / n,
            "plan_ms_median": statistics.median(plan_ms),
            "mean_slowest_stage_ms": 1e3 * statistics.fmean(balance),
            "mean_stage_sum_ms": 1e3 * statistics.fmean(stage_sum),
        }
    d, s, o = (out[k]["subnets_per_hour"] for k in ("dynamic", "static", "oracle"))
    out["dynamic_over_static"] = d / s
    out["dynamic_over_oracle"] = d / o
    out["dynamic_all_wait_over_static"] = out["dynamic_all_wait"]["subnets_per_hour"] / s
    # compute(+comm) balance alone: what a FLOP model of the op mix predicts
    out["static_over_oracle_slowest_stage"] = (out["static"]["mean_slowest_stage_ms"]
                                               / out["oracle"]["mean_slowest_stage_ms"])
    out["static_over_dynamic_slowest_stage"] = (out["static"]["mean_slowest_stage_ms"]
                                                / out["dynamic"]["mean_slowest_stage_ms"])
    # 1F1B makespan ~ sum of the stages (fill + drain, the same for any split) + (M - 1) x slowest:
    # the throughput gain the slowest-stage gain turns into once the bubble dilutes it.
    def makespan(k: str) -> float:
        return out[k]["mean_stage_sum_ms"] + (M - 1) * out[k]["mean_slowest_stage_ms"]
    out["dynamic_over_static_makespan_model"] = makespan("static") / makespan("dynamic")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subnets", type=int, default=1000)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--extra-eps", type=float, nargs="*", default=[0.0, 0.02],
                    help="also run the dynamic planner with these eps (sensitivity)")
    ap.add_argument("--objective", choices=["step", "minmax"], default="step",
                    help="the dynamic planner's objective (the runtime's pipeline.objective); with 'step' the "
                         "minmax planner runs too, as dynamic_minmax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    ap.add_argument("--cached-profile", action="store_true",
                    help="reuse a cached profile (default: measure afresh, under this run's machine load)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for source in args.sources:
        cfg = SOURCES[source]
        graph = transformer.build(input_shape=cfg["sample_shape"], num_classes=10, preset="naspipe", layers=48,
                                  width=cfg["width"])
        t0 = time.perf_counter()
        if source == "measured":
            table = measured_costs(graph, cfg["sample_shape"], cfg["microbatch"], "sgd", "cpu", repeats=15,
                                   use_cache=args.cached_profile)
            progress("measuring the gloo loopback link ...")
            link = spawn(2, "bench._spawn:link_worker", {})
        else:
            table = analytic_costs(graph, cfg["sample_shape"], cfg["microbatch"], "sgd", **cfg["rates"])
            link = cfg["link"]
        progress(f"{source}: cost table in {time.perf_counter() - t0:.1f} s ({table.source}); link {link}")
        archs = [graph.space().random(rng) for rng in [random.Random(args.seed)] for _ in range(args.subnets)]
        cv = layer_cost_cv(graph, table)
        for P in args.stages:
            for M in args.microbatches:
                t0 = time.perf_counter()
                res = run_setting(graph, table, archs, P, M, link, args.eps, args.extra_eps, args.objective)
                progress(f"{source} P={P} M={M}: {time.perf_counter() - t0:.1f} s, "
                         f"dynamic/static {res['dynamic_over_static']:.3f}, "
                         f"dynamic/oracle {res['dynamic_over_oracle']:.3f}")
                rows.append({
                    "bench": "naspipe_planner", "source": source, "cost_source": table.source,
                    "width": cfg["width"], "microbatch": cfg["microbatch"], "sample_shape": list(cfg["sample_shape"]),
                    "layers": 48, "candidates": 24, "P": P, "M": M, "schedule": SCHEDULE, "eps": args.eps, "objective": args.objective,
                    "subnets": args.subnets, "seed": args.seed, "link": link, "layer_cost_cv": cv,
                    **res, "baseline": "static (StaticPlanner.from_problem(mean_problem)) and oracle, same run",
                    "loadavg": os.getloadavg()[0],
                })
    emit("naspipe_planner", rows)


if __name__ == "__main__":
    main()
