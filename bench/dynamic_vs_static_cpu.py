"""Issue 4 on real processes: dynamic vs static (and equal-count) partitioning, P=2, gloo, CPU,
and a check of the simulator against the measured step times.

Spaces (``--space``; transformer, width 256, SGD with momentum, 1F1B, M in ``--microbatches``):

* ``spread`` (the demonstration): 12 layers over six candidates whose costs spread widely (a
  16x FFN, GLU, attention, cheap convolutions, a skip), batches of 64 samples of 32 tokens, so
  that a step takes about a second and per-message latency is a small part of it;
* ``mix``: 8 layers of ffn8 / identity / attn4 / conv5, batches of 32 x 16 tokens (a smaller
  predicted gain, ~5-8 %, of the size of this machine's noise);
* ``skewed``: 6 layers of ffn16 / identity.

Every rank plans with the measured profile (pipeline.profile.shared_profile, passed as
PipelineEngine(costs=...)) and the link measured with the runtime's transport. The planners
(dynamic with the step objective, static, equal, and dynamic with the minmax objective at each
--extra-eps) run in the SAME invocation on the same arch stream and data: one engine per
planner, stepped in turn (step k of each, then step k + 1; the order rotates every step), so
they see the same machine. Headline: throughput over the measured steps (samples / total time
of the same subnets), dynamic over static, with a 90 % bootstrap interval over the paired
steps; the steps where both planners cut alike give the noise floor.

Also measured in the same run: how much slower one rank computes while the other computes too
(``two_ranks_computing_at_once``: the two cores of this VM share caches and memory bandwidth,
so a balanced pipeline runs its ops slower than the one-process profile says).

Simulator check: before each step the engine's own (pure) plan is read with ``engine.plan``;
the step is predicted with pipeline.plan.simulate.simulate from the profile's per-op fwd/bwd times
summed per stage and send = latency + cut bytes / bandwidth, plus the planner's migration model
(moved bytes / bandwidth + latency per moved op). Measured step time: the slowest rank's wall
time of the step. A bench-only probe times each engine's migration phase, so the error is also
given for the pipeline part alone (step minus migration). ``contention``, the compute wall time
per CPU second the ranks got, marks the steps that ran undisturbed by other jobs.

Profile check without the pipeline: every ``--profile-check-every`` steps rank 0 alone (rank 1
idle in a barrier) runs the same step in a single-process ReferenceEngine, predicted as
M x sum(fwd + bwd). Every step's raw figures go to bench/out/dynamic_vs_static_cpu_steps.json.

    python bench/dynamic_vs_static_cpu.py [--space spread] [--microbatches 4 8] [--steps 62]   # ~7 min
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import (  # noqa: E402
    OUT, QUIET, contention, emit, measure_interference, measure_link, measured_step, progress, spawn,
)

SPACES = {
    # NASPipe-like mix: per-layer candidate costs spread moderately (the gain is a few per cent)
    "mix": dict(layers=8, width=256, candidates=["ffn8", "identity", "attn4", "conv5"], sample=(16, 32), batch=32),
    # strongly skewed costs: a wide FFN or nothing; a static split is often far off balance
    "skewed": dict(layers=6, width=256, candidates=["ffn16", "identity"], sample=(16, 32), batch=32),
    # a wide spread over six candidates (one heavy FFN, cheap convolutions, GLU, attention, a skip),
    # 12 layers, and batches large enough that per-message latency is a small part of a step
    "spread": dict(layers=12, width=256, candidates=["ffn16", "conv1", "glu", "identity", "sepconv3", "attn2"],
                   sample=(32, 32), batch=64),
}
P = 2
PLANNERS = ("dynamic", "static", "equal")
SCHEDULE = "1f1b"


def _graph(space: dict):
    from supernet.spaces import build_space

    return build_space("transformer", input_shape=tuple(space["sample"]), num_classes=10, layers=space["layers"],
                       width=space["width"], candidates=space["candidates"])


def _data(space: dict, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    batch, sample = space["batch"], tuple(space["sample"])
    return torch.randn(batch, *sample, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _predict(engine, plan, table, schedule, latency: float, bandwidth: float) -> dict:
    """The simulated step of ``plan`` under the measured profile, before it runs."""
    from pipeline.plan.placement import moves
    from pipeline.plan.simulate import simulate

    fwd = [sum(table.ops[op.op_id].fwd for op in sl.ops) for sl in plan.slices]
    bwd = [sum(table.ops[op.op_id].bwd for op in sl.ops) for sl in plan.slices]
    send = [latency + sum(table.out_bytes[n] for n in sl.outputs) / bandwidth for sl in plan.slices[:-1]]
    sim = simulate(schedule, fwd, bwd, send)
    todo = moves([op for sl in plan.slices for op in sl.ops], plan.partition.bounds, engine.owners)
    migration = plan.partition.moved_bytes / bandwidth + len(todo) * latency
    # what the transport really does per moved op: a header and a metadata message, then one
    # message per tensor of its flat state (weights, buffers, one momentum buffer per weight),
    # each received (and so woken up for) in turn
    messages = sum(2 + _state_tensors(engine, mv.op_id) for mv in todo)
    return {"step": sim.step_time + migration, "pipeline": sim.step_time, "migration": migration,
            "migration_per_message": plan.partition.moved_bytes / bandwidth + messages * latency,
            "busy": list(sim.busy), "moves": len(todo), "messages": messages, "bounds": list(plan.partition.bounds)}


def _state_tensors(engine, op_id: str) -> int:
    from supernet import build_op

    spec = next(s.spec for s in engine.graph.slots() if s.op_id == op_id)
    with torch.device("meta"):
        module = build_op(spec, op_id, 0)
    params = len(list(module.parameters()))
    return 2 * params + len(list(module.buffers()))  # SGD with momentum: one buffer per weight


def _ffn_work(space: dict, microbatch: int):
    """One micro-batch forward and backward through a wide FFN (the heaviest kind of op here)."""
    tokens, width = microbatch * space["sample"][0], space["width"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g)
    w1 = torch.randn(width, 16 * width, generator=g, requires_grad=True)
    w2 = torch.randn(16 * width, width, generator=g, requires_grad=True)

    def work() -> None:
        (torch.relu(x @ w1) @ w2).sum().backward()
    return work


def worker(spec: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from pipeline import DistEnv, LrSchedule, OptimConfig, PipelineSettings, ReferenceEngine
    from pipeline.profile import shared_profile
    from pipeline.runtime import PipelineEngine

    latency, bandwidth = measure_link(rank)
    space = SPACES[spec["space"]]
    graph = _graph(space)
    sample, batch = tuple(space["sample"]), space["batch"]
    interference = measure_interference(rank, _ffn_work(space, batch // max(spec["microbatches"])))
    archs = [graph.space().random(rng) for rng in [random.Random(spec["seed"])] for _ in range(spec["steps"])]
    optim = OptimConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
    lr = LrSchedule(optim.lr, 1000)
    out = {"link": {"latency_s": latency, "bandwidth": bandwidth}, "interference": interference, "settings": []}
    for M in spec["microbatches"]:
        table = shared_profile(graph, sample, batch // M, "sgd", rank, world, "cpu", repeats=15,
                               use_cache=spec["cached_profile"])
        engines = {}
        for label, planner, eps in spec["planners"]:
            objective = "minmax" if label.startswith("dynamic_minmax") else "step"
            engines[label] = PipelineEngine(
                graph, spec["seed"], optim, M, lr,
                PipelineSettings(schedule=SCHEDULE, planner=planner, eps=eps, timeout_s=120.0,
                                 link_bandwidth=bandwidth, link_latency_s=latency, objective=objective,
                                 migration_overhead_s=spec["migration_overhead_s"]),
                DistEnv(rank, world, rank), torch.device("cpu"), costs=table)
        steps: dict[str, list] = {label: [] for label in engines}
        # profile check without the pipeline: rank 0 alone runs the same step in one process
        reference = ReferenceEngine(graph, spec["seed"], optim, M, lr, "cpu") if rank == 0 else None
        single = []
        for step, arch in enumerate(archs):
            x, y = _data(space, spec["seed"], step)
            labels = list(engines)
            labels = labels[step % len(labels):] + labels[:step % len(labels)]  # no planner always goes first
            for label in labels:
                engine = engines[label]
                # the planner exists once the first step made it; step 0 is a warm-up anyway
                pred = _predict(engine, engine.plan(arch), table, engine.schedule, latency, bandwidth) \
                    if engine.planner.planner is not None else None
                r, ranks = measured_step(engine, step, arch, x, y, archs[step + 1 : step + 3])
                steps[label].append({"loss": r.loss, "ranks": ranks, "pred": pred})
            if reference is not None and step % spec["profile_check_every"] == 0:
                t0, c0 = time.perf_counter(), time.process_time()
                reference.train_step(step, arch, x, y)
                single.append((step, time.perf_counter() - t0, time.process_time() - c0,
                               M * sum(table.ops[op.op_id].fwd + table.ops[op.op_id].bwd
                                       for op in graph.active_ops(arch))))
            dist.barrier()
        out["settings"].append({"M": M, "steps": steps, "single_process": single})
    return out


def _cut_class(pairs: list[tuple[dict, dict]]) -> dict:
    """Static over dynamic, summed over paired steps (dynamic's step, static's step): the step
    time measured and predicted, the slowest rank's compute measured and predicted, and the
    compute summed over both ranks (the same ops either way: above 1 where dynamic's ran faster)."""
    if not pairs:
        return {"steps": 0}

    def ratio(f) -> float:
        return sum(f(s) for _, s in pairs) / sum(f(d) for d, _ in pairs)
    return {"steps": len(pairs),
            "ratio": ratio(lambda st: max(r["wall_s"] for r in st["ranks"])),
            "predicted": ratio(lambda st: st["pred"]["step"]),
            "slowest_rank_compute": ratio(lambda st: max(r["busy_s"] for r in st["ranks"])),
            "predicted_slowest_rank_compute": ratio(lambda st: max(st["pred"]["busy"])),
            "compute_summed_over_ranks": ratio(lambda st: sum(r["busy_s"] for r in st["ranks"]))}


def _bootstrap_ratio(dynamic: list[float], static: list[float], n: int = 2000, seed: int = 0) -> list[float]:
    """5th and 95th percentiles of sum(static) / sum(dynamic) over steps resampled in pairs."""
    rng = random.Random(seed)
    idx = range(len(dynamic))
    ratios = sorted(sum(static[i] for i in pick) / sum(dynamic[i] for i in pick)
                    for pick in ([rng.choice(idx) for _ in idx] for _ in range(n)))
    return [ratios[int(0.05 * n)], ratios[int(0.95 * n) - 1]]


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def _med(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else None


def summarize(steps: list[dict], batch: int) -> dict:
    """One planner's figures over its measured steps."""
    wall = [max(r["wall_s"] for r in s["ranks"]) for s in steps]
    mig = [max(r["migration_s"] for r in s["ranks"]) for s in steps]
    cont = [contention(sum(r["busy_s"] for r in s["ranks"]), sum(r["cpu_s"] for r in s["ranks"])) for s in steps]
    pred = [s["pred"] for s in steps]
    err = [_rel(p["step"], w) for p, w in zip(pred, wall)]
    err_pipe = [_rel(p["pipeline"], w - m) for p, w, m in zip(pred, wall, mig)]
    quiet = [i for i, c in enumerate(cont) if c <= QUIET]
    return {
        "samples_per_s": batch / _med(wall),
        "samples_per_s_without_migration": batch / _med(w - m for w, m in zip(wall, mig)),
        "predicted_samples_per_s": batch / _med(p["step"] for p in pred),
        "step_ms_median": 1e3 * _med(wall),
        "predicted_step_ms_median": 1e3 * _med(p["step"] for p in pred),
        "migrated_ops_per_step": statistics.fmean(s["ranks"][0]["migrated_ops"] for s in steps),
        "migrated_bytes_per_step": statistics.fmean(s["ranks"][0]["migrated_bytes"] for s in steps),
        "migration_ms_mean": 1e3 * statistics.fmean(mig),
        "predicted_migration_ms_mean": 1e3 * statistics.fmean(p["migration"] for p in pred),
        "predicted_migration_per_message_ms_mean": 1e3 * statistics.fmean(p["migration_per_message"] for p in pred),
        "migration_messages_per_step": statistics.fmean(p["messages"] for p in pred),
        "predicted_moves_agree": all(p["moves"] == s["ranks"][0]["migrated_ops"] for p, s in zip(pred, steps)),
        "sim_abs_rel_error_median": _med(abs(e) for e in err),
        "sim_signed_rel_error_median": _med(err),
        "sim_pipeline_only_abs_rel_error_median": _med(abs(e) for e in err_pipe),
        "sim_pipeline_only_signed_rel_error_median": _med(err_pipe),
        "measured_busy_imbalance_median": _med(
            max(r["busy_s"] for r in s["ranks"]) / (sum(r["busy_s"] for r in s["ranks"]) / P) for s in steps),
        "predicted_busy_imbalance_median": _med(max(p["busy"]) / (sum(p["busy"]) / P) for p in pred),
        "measured_busy_sum_ms_median": 1e3 * _med(sum(r["busy_s"] for r in s["ranks"]) for s in steps),
        "predicted_busy_sum_ms_median": 1e3 * _med(sum(p["busy"]) for p in pred),
        "contention_median": _med(cont), "quiet_steps": len(quiet),
        "quiet_samples_per_s": batch / _med(wall[i] for i in quiet) if quiet else None,
        "quiet_sim_abs_rel_error_median": _med(abs(err[i]) for i in quiet),
        "quiet_sim_pipeline_only_abs_rel_error_median": _med(abs(err_pipe[i]) for i in quiet),
        "_err": err, "_err_pipe": err_pipe,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=62, help="steps per planner, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--space", choices=sorted(SPACES), default="spread")
    ap.add_argument("--migration-overhead", type=float, default=2e-3,
                    help="pipeline.migration_overhead_s of the dynamic planner (seconds per moved op)")
    ap.add_argument("--extra-eps", type=float, nargs="*", default=[],
                    help="also run the dynamic planner with these eps (fewer migrations)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--profile-check-every", type=int, default=4,
                    help="run the single-process profile check every this many steps")
    ap.add_argument("--cached-profile", action="store_true",
                    help="reuse a cached profile (default: measure afresh, under this run's machine load)")
    args = ap.parse_args()
    planners = [("dynamic", "dynamic", args.eps), ("static", "static", args.eps), ("equal", "equal", args.eps),
                *((f"dynamic_minmax_eps{e:g}", "dynamic", e) for e in args.extra_eps)]
    spec = {"space": args.space, "profile_check_every": args.profile_check_every, "migration_overhead_s": args.migration_overhead, "seed": args.seed, "steps": args.steps, "planners": planners, "microbatches": args.microbatches,
            "threads": 1, "timeout_s": 600, "cached_profile": args.cached_profile}
    progress(f"{P} gloo ranks, planners {[p[0] for p in planners]}, M in {args.microbatches}, "
             f"{args.steps} steps each ...")
    t0 = time.perf_counter()
    res = spawn(P, "bench.dynamic_vs_static_cpu:worker", spec, timeout_s=1800)
    progress(f"done in {time.perf_counter() - t0:.1f} s; link {res['link']}")
    raw = OUT / "dynamic_vs_static_cpu_steps.json"  # every step of every planner, for a closer look
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(res))
    rows, all_err, all_err_pipe = [], [], []
    for setting in res["settings"]:
        M = setting["M"]
        space = SPACES[args.space]
        row = {"bench": "dynamic_vs_static_cpu", "P": P, "M": M, "schedule": SCHEDULE, "batch": space["batch"],
               "space": dict(space, name="transformer", key=args.space, sample=list(space["sample"])), "eps": args.eps,
               "steps_measured": args.steps - args.warmup, "link": res["link"],
               "two_ranks_computing_at_once": res["interference"]}
        setting_err, setting_err_pipe, losses = [], [], {}
        for label, _, _ in planners:
            fig = summarize(setting["steps"][label][args.warmup:], space["batch"])
            setting_err += [abs(e) for e in fig.pop("_err")]
            setting_err_pipe += [abs(e) for e in fig.pop("_err_pipe")]
            losses[label] = [s["loss"] for s in setting["steps"][label]]
            row[label] = fig
        d, s_, e = row["dynamic"], row["static"], row["equal"]
        row["dynamic_over_static"] = d["samples_per_s"] / s_["samples_per_s"]
        row["dynamic_over_equal"] = d["samples_per_s"] / e["samples_per_s"]
        row["dynamic_over_static_without_migration"] = d["samples_per_s_without_migration"] / s_["samples_per_s"]
        row["predicted_dynamic_over_static"] = d["predicted_samples_per_s"] / s_["predicted_samples_per_s"]
        # the same subnet's step under both planners, stepped back to back: the pairing takes the
        # subnet-to-subnet spread and slow drifts of the machine out of the comparison
        walls = {k: [max(r["wall_s"] for r in st["ranks"]) for st in setting["steps"][k][args.warmup:]]
                 for k in setting["steps"]}
        paired = sorted(sw / dw for dw, sw in zip(walls["dynamic"], walls["static"]))
        row["paired_static_over_dynamic_step"] = {
            "median": _med(paired), "q25": paired[len(paired) // 4], "q75": paired[(3 * len(paired)) // 4],
            "dynamic_faster_fraction": sum(r > 1 for r in paired) / len(paired)}
        # throughput = samples / total time over the same subnets; a bootstrap over the paired
        # steps gives its spread, and the steps where both planners cut alike show the noise floor
        row["dynamic_over_static_throughput"] = sum(walls["static"]) / sum(walls["dynamic"])
        row["dynamic_over_static_throughput_ci90"] = _bootstrap_ratio(walls["dynamic"], walls["static"])
        predicted = {k: sum(st["pred"]["step"] for st in setting["steps"][k][args.warmup:]) for k in ("dynamic", "static")}
        row["predicted_dynamic_over_static_throughput"] = predicted["static"] / predicted["dynamic"]
        pairs = list(zip(setting["steps"]["dynamic"][args.warmup:], setting["steps"]["static"][args.warmup:]))
        for key, keep in (("same_cut", True), ("different_cut", False)):
            row[f"dynamic_over_static_throughput_{key}"] = _cut_class(
                [(d_, s2) for d_, s2 in pairs if (d_["pred"]["bounds"] == s2["pred"]["bounds"]) == keep])
        for label, _, _ in planners:
            row[label]["samples_per_s_total"] = space["batch"] * len(walls[label]) / sum(walls[label])
        row["dynamic_over_equal_throughput"] = sum(walls["equal"]) / sum(walls["dynamic"])
        for label, _, _ in planners[3:]:
            row[f"{label}_over_static"] = row[label]["samples_per_s"] / s_["samples_per_s"]
        single = [tuple(r[1:]) for r in setting["single_process"] if r[0] >= args.warmup]
        row["profile_check_single_process"] = None if not single else {
            "what": "one process, 1 thread, same steps: step wall / CPU time vs M x sum(fwd + bwd) of the profile",
            "abs_rel_error_median": _med(abs(_rel(p, t)) for t, _, p in single),
            "signed_rel_error_median": _med(_rel(p, t) for t, _, p in single),
            "cpu_abs_rel_error_median": _med(abs(_rel(p, c)) for _, c, p in single),
            "cpu_signed_rel_error_median": _med(_rel(p, c) for _, c, p in single),
            "step_ms_median": 1e3 * _med(t for t, _, _ in single),
            "step_cpu_ms_median": 1e3 * _med(c for _, c, _ in single),
            "predicted_ms_median": 1e3 * _med(p for _, _, p in single)}
        row["losses_equal_across_planners"] = all(v == losses["dynamic"] for v in losses.values())
        row["sim_abs_rel_error_median_setting"] = _med(setting_err)
        row["sim_pipeline_only_abs_rel_error_median_setting"] = _med(setting_err_pipe)
        row["loadavg"] = os.getloadavg()[0]
        row["baseline"] = "static and equal planners, same arch stream, stepped in turn in the same run"
        all_err += setting_err
        all_err_pipe += setting_err_pipe
        rows.append(row)
    for row in rows:
        row["sim_abs_rel_error_median_all"] = _med(all_err)
        row["sim_pipeline_only_abs_rel_error_median_all"] = _med(all_err_pipe)
    emit("dynamic_vs_static_cpu", rows)


if __name__ == "__main__":
    main()
