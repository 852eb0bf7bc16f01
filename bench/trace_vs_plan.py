"""Where a traced step's time goes, per stage and kind of work, beside what the simulator predicted.

``python bench/trace_vs_plan.py RUN_DIR`` reads a run directory (``trace.json``, ``metrics.jsonl``,
``summary.json``, ``.hydra/config.yaml``); ``--run`` first trains one itself: a torchrun P = 2 job
(``search=none``) that traces ``--trace`` steps, any extra ``key=value`` Hydra overrides passed
through (``python bench/trace_vs_plan.py --run space=transformer space.width=256 space.layers=8``).

Measured, per traced step and rank, from the spans: the rank's *cycle* (from its first span of
the step to its first span of the next traced step; the last traced step, which has no next, is
left out of the medians unless it is the only one) split by kind. Each instant of the cycle goes
to the innermost span covering it (spans nest: a forward action holds its receive wait and its
send), so nothing is counted twice and the kinds sum to the cycle:

* ``forward``, ``backward``, ``optimizer``: compute (an action's span minus the waits and sends
  inside it, i.e. the Python of the action included);
* ``recv_wait``, ``send``: the schedule's messages (a gloo send blocks until the peer takes it);
* ``optimizer``, ``reduce`` (replicated stages: the gradient reduction inside the update);
* ``migrate`` (``migrate``, ``migrate-ahead``, ``swap``), ``plan``; ``other`` (any category not
  listed);
* ``rest``: what no span covers: Python between the spans (the step's set-up, the app's metrics
  and data between steps) and idle time.

Predicted, per step: the plan of the step's subnet, replayed with the same pure planner
(:class:`pipeline.lookahead.LookaheadPlanner`: same graph, seed, settings, schedule and what the
run planned with: its ``costs.json`` when it chose its layout from measured costs, else the
analytic table; neither the trace nor ``metrics.jsonl`` records the partition bounds) chained
from the initial placement over every step before it, is simulated as the runtime runs it (a
flushed step and its update, :func:`pipeline.plan.simulate.simulate`): per stage ``forward``,
``backward``, ``optimizer`` / ``reduce`` (the update, priced only with runtime costs),
``recv_wait`` (gaps before an action: waiting for its input) and ``rest`` (after the stage's
last action until the makespan). Twice: ``predicted_ms``, priced as the run's planner priced it
(before issue 23: the analytic table alone), and ``predicted_measured_ms``, priced with the
measured costs (the op profile, :mod:`pipeline.profile`, and the runtime costs of
:mod:`pipeline.calibrate`: actions, updates, the replicas' reduction, the link; the run's own
when it recorded them). Replicated stages (R > 1) replay one replica's pipeline on its M / R
micro-batches. The replay is checked against the run: its number of op moves per step must
equal ``metrics.jsonl``'s ``migrated_ops``.

One JSON line per rank (medians over the traced steps; medians of parts need not sum to the
median cycle), a table on stderr. The baseline is the prediction itself, for the same steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import ROOT, emit, progress  # noqa: E402
from pipeline.trace import Span, spans_from_chrome  # noqa: E402

__all__ = ["KINDS", "kind_of", "breakdown", "measured", "predicted_breakdown", "replay_plans", "report"]

KINDS = ("forward", "backward", "optimizer", "reduce", "recv_wait", "send", "migrate", "plan", "other", "rest")
COMPUTE_KINDS = ("forward", "backward", "optimizer")
_CAT = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "recv-wait": "recv_wait",
        "send": "send", "migrate": "migrate", "migrate-ahead": "migrate", "swap": "migrate", "plan": "plan",
        "reduce": "reduce"}
SCHEDULE_CATS = frozenset({"forward", "backward"})


class TraceReportError(ValueError):
    """A run directory this report cannot read: a file missing, no traced steps, a layout it does not replay."""


def kind_of(cat: str) -> str:
    return _CAT.get(cat, "other")


def breakdown(spans: Iterable[Span], start: float, end: float) -> dict[str, float]:
    """Seconds of ``[start, end)`` per kind (:data:`KINDS`) on one rank: each instant goes to the
    innermost span covering it (latest start; the shorter at equal starts), ``rest`` where none
    does. The kinds sum to ``end - start``; overlapping spans are not counted twice."""
    inside = [s for s in spans if s.end_s > start and s.start_s < end and s.dur_s > 0]
    cuts = sorted({start, end, *(min(max(t, start), end) for s in inside for t in (s.start_s, s.end_s))})
    out = dict.fromkeys(KINDS, 0.0)
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        over = [s for s in inside if s.start_s <= mid < s.end_s]
        kind = kind_of(max(over, key=lambda s: (s.start_s, -s.dur_s)).cat) if over else "rest"
        out[kind] += b - a
    return out


def measured(spans: Sequence[Span]) -> dict[int, dict[int, dict[str, float]]]:
    """Per traced step and rank: :func:`breakdown` of the rank's cycle (see the module doc) plus
    ``cycle`` (its length), ``schedule`` (the step's forward/backward extent over all ranks: the
    makespan the simulator predicts) and ``full`` (whether the cycle ran to the next traced step)."""
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_rank[s.rank].append(s)
    steps = sorted({s.step for s in spans if s.step >= 0})
    out: dict[int, dict[int, dict[str, float]]] = {}
    for step in steps:
        work = [s for s in spans if s.step == step and s.cat in SCHEDULE_CATS]
        extent = (max(s.end_s for s in work) - min(s.start_s for s in work)) if work else 0.0
        out[step] = {}
        for rank, track in sorted(by_rank.items()):
            mine = [s for s in track if s.step == step]
            if not mine:
                continue
            t0 = min(s.start_s for s in mine)
            nxt = [s.start_s for s in track if s.step == step + 1]
            t1 = min(nxt) if nxt else max(s.end_s for s in mine)
            row = breakdown(track, t0, t1)
            out[step][rank] = {**row, "cycle": t1 - t0, "schedule": extent, "full": bool(nxt)}
    return out


def predicted_breakdown(sim, reduce: Sequence[float] | None = None) -> list[dict[str, float]]:
    """Per stage of a :class:`~pipeline.plan.simulate.SimResult`: forward, backward, the update
    (``optimizer``, less ``reduce[s]``, its replica reduction, counted apart), the waits before
    actions (``recv_wait``), ``rest`` after the stage's last action until the makespan, and
    ``makespan``; the other kinds are 0 (the simulator sends asynchronously and moves for free)."""
    rows = []
    for s, line in enumerate(sim.timeline):
        row = dict.fromkeys(KINDS, 0.0)
        free = 0.0
        for sp in line:
            if sp.end <= sp.start:
                continue  # an update priced at nothing (the analytic table's)
            row["recv_wait"] += max(0.0, sp.start - free)
            if sp.action.kind == "U":
                red = min(reduce[s], sp.end - sp.start) if reduce else 0.0
                row["reduce"] += red
                row["optimizer"] += sp.end - sp.start - red
            else:
                row["forward" if sp.action.kind == "F" else "backward"] += sp.end - sp.start
            free = sp.end
        row["rest"] = sim.step_time - free
        row["makespan"] = sim.step_time
        rows.append(row)
    return rows


def run_costs(run_dir: Path):
    """What the run planned with, from its ``costs.json`` (written when its layout was chosen from
    measured costs): the cost table and the runtime costs; (None, None) without one."""
    from pipeline.plan.overhead import RuntimeCosts
    from pipeline.profile import table_from_json

    path = run_dir / "costs.json"
    if not path.is_file():
        return None, None
    d = json.loads(path.read_text())
    return table_from_json(d["table"]), RuntimeCosts.from_json(d["runtime"])


def measured_pricing(run_dir: Path, graph, sample_shape, microbatch: int, optimizer: str, world: int):
    """The measured costs to price a replay with: the run's own (``costs.json``), else this
    machine's profile (``pipeline.profile``, cached) and its calibrated runtime costs from the
    cache (:mod:`pipeline.calibrate`; without one, the link defaults and nothing else)."""
    from pipeline.calibrate import cached_costs
    from pipeline.profile import measured_costs

    table, runtime = run_costs(run_dir)
    if table is None:
        table = measured_costs(graph, sample_shape, microbatch, optimizer, "cpu")
    if runtime is None:
        runtime = cached_costs("cpu", "gloo", world, optimizer)
    return table, runtime


# -- the plans of the run --------------------------------------------------------------------

def replay_plans(run_dir: Path, steps: Iterable[int], priced: bool = False) -> tuple[dict[int, dict], dict]:
    """The predicted breakdown per stage of each step in ``steps``, from the run's plans replayed
    (module doc), and what the replay found: ``moves_match`` (steps whose replayed op moves equal
    ``metrics.jsonl``'s ``migrated_ops``), ``steps_checked``, ``bounds`` per step. The plans are
    made with what the run planned with (its ``costs.json``, else the analytic table); they are
    priced with the same, or with ``priced`` the measured costs (:func:`measured_pricing`: the
    op profile, the actions, updates, reductions and the link)."""
    import torch
    from omegaconf import OmegaConf

    from pipeline.layout import resolve_layout
    from pipeline.lookahead import LookaheadPlanner
    from pipeline.memory.sizing import MemoryModel
    from pipeline.plan.admission import sequential
    from pipeline.plan.costs import subnet_problem
    from pipeline.plan.overhead import subnet_work
    from pipeline.plan.partition import stage_work
    from pipeline.plan.placement import initial_owners
    from pipeline.plan.schedule import build as build_schedule
    from pipeline.plan.simulate import simulate
    from search.config import build_data, build_space, load_config
    from supernet import cut

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    rc = load_config(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    space = graph.space()
    t, ps = rc.train, rc.pipeline
    world = int(summary["world_size"])
    ran = summary.get("layout") or {}
    if ran.get("stages"):
        P, R, W = int(ran["stages"]), int(ran["replicas"]), ran.get("window") or ps.window
    else:
        layout = resolve_layout(ps, rc.memory, world, t.microbatches, graph, t.optimizer.name, data.input_shape,
                                t.batch_size)
        P, R, W = layout.stages, layout.replicas, ps.window
    if W != 1 or ps.shared_ops != "exact" or rc.memory.virtual:
        raise TraceReportError(f"{run_dir}: expected flushed steps (window 1, exact shared ops) without a memory "
                               f"budget, found window {W}, shared_ops {ps.shared_ops!r}, memory virtual "
                               f"{rc.memory.virtual}; this report replays only that case")
    M = t.microbatches // R  # a replica's micro-batches
    mb = t.batch_size // t.microbatches
    schedule = build_schedule(ps.schedule, P, M)
    table, runtime = run_costs(run_dir)
    planner = LookaheadPlanner(graph, rc.seed, P, M, dataclasses.replace(ps, window=1), table, can_move_early=P > 1,
                               optim_name=t.optimizer.name, memory=MemoryModel(rc.memory), schedule=schedule,
                               runtime=runtime, replicas=R)
    # the table at the first batch's shape, as the engine makes it (training=False: no wire specs)
    planner.ensure(torch.zeros(t.batch_size, *data.input_shape), mb, training=False)
    if priced and rc.threads is not None:
        torch.set_num_threads(rc.threads)  # the run's: a CPU profile is keyed (and timed) by its thread count
    price = measured_pricing(run_dir, graph, data.input_shape, mb, t.optimizer.name, world) if priced else None
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    records.sort(key=lambda r: r["step"])
    wanted = set(steps)
    last = max(wanted)
    archs = [space.validate(r["arch"], f"metrics.jsonl step {r['step']}") for r in records if r["step"] <= last]
    if len(archs) != last + 1 or records[0]["step"] != 0:
        raise TraceReportError(f"{run_dir / 'metrics.jsonl'}: expected every step 0..{last} (the replay starts "
                               f"from the first), found {len(archs)} (a resumed run is not replayed)")
    owners = initial_owners(graph.slots(), P)
    out, matches, bounds = {}, 0, {}
    for (key, plan), rec in zip(planner.chain(archs, owners, None), records):
        # chain updates ``owners`` after yielding: ``key[2]`` holds the owners before this plan
        before = dict(zip((op.op_id for op in plan.active), key[2]))
        moved = sum(before[op] != s for op, s in planner.placed(plan).items())
        matches += moved == rec["migrated_ops"]
        step = rec["step"]
        if step not in wanted:
            continue
        b = plan.partition.bounds
        bounds[step] = list(b)
        if price is None and runtime is None:
            fwd, bwd, send = stage_work(planner.problem(plan.arch), b)
            out[step] = predicted_breakdown(simulate(schedule, fwd, bwd, send))
            continue
        tab, rt = price if price is not None else (planner.costs, runtime)
        active = graph.active_ops(plan.arch)
        problem = subnet_problem(graph, active, tab, P, M, schedule, rt.bandwidth, rt.latency_s)
        uses = [frozenset(op.op_id for op in sl.ops) for sl in cut(active, b, graph.output)]
        work = subnet_work(problem, b, uses, rt, R, ps.reduce)
        reduce = [rt.reduce_s(sum(o.param_bytes for o in problem.ops[b[k]:b[k + 1]]), R, ps.reduce) for k in range(P)]
        out[step] = predicted_breakdown(simulate(sequential(schedule, [uses]), work=[work]), reduce)
    where = (f"{price[0].source} ops, {price[1].source} runtime costs" if price is not None else
             f"{table.source} ops, {runtime.source} runtime costs" if runtime is not None else "analytic costs")
    return out, {"moves_match": matches, "steps_checked": len(archs), "bounds": bounds, "priced_with": where,
                 "space": rc.space.target, "stages": P, "replicas": R, "microbatches": t.microbatches}


# -- the report -------------------------------------------------------------------------------

def _median(rows: Sequence[Mapping[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _predicted(p: Sequence[Mapping[str, float]]) -> dict[str, float]:
    pk = {k: 1e3 * _median(p, k) for k in (*KINDS, "makespan")}
    pk["compute"] = 1e3 * statistics.median(sum(r[k] for k in COMPUTE_KINDS) for r in p)
    return {k: round(v, 3) for k, v in pk.items()}


def report(run_dir: Path, priced: bool = True) -> list[dict]:
    """One row per rank: medians over the traced steps, measured and predicted, in ms: as the
    run's planner saw them (``predicted_ms``) and, with ``priced``, with the measured costs
    (``predicted_measured_ms``: the op profile and the runtime costs of :mod:`pipeline.calibrate`)."""
    path = run_dir / "trace.json"
    if not path.is_file():
        raise TraceReportError(f"{path}: expected the trace of a run with pipeline.trace_steps, found no such file")
    spans = spans_from_chrome(json.loads(path.read_text()))
    meas = measured(spans)
    if not meas:
        raise TraceReportError(f"{path}: expected spans of traced steps, found none")
    full = [s for s, ranks in meas.items() if all(r["full"] for r in ranks.values())] or sorted(meas)
    pred, info = replay_plans(run_dir, full)
    after, info_after = replay_plans(run_dir, full, priced=True) if priced else (None, None)
    P = info["stages"]
    rows = []
    for rank in sorted({r for s in full for r in meas[s]}):
        m = [meas[s][rank] for s in full if rank in meas[s]]
        mk = {k: 1e3 * _median(m, k) for k in (*KINDS, "cycle", "schedule")}
        mk["compute"] = 1e3 * statistics.median(sum(r[k] for k in COMPUTE_KINDS) for r in m)
        row = {
            "bench": "trace_vs_plan", "run_dir": str(run_dir), "space": info["space"], "rank": rank,
            "stage": rank % P, "stages": P, "replicas": info["replicas"], "microbatches": info["microbatches"],
            "steps": full, "measured_ms": {k: round(v, 3) for k, v in mk.items()},
        }
        for name, pr, inf in (("predicted", pred, info), ("predicted_measured", after, info_after)):
            if pr is None:
                continue
            p = [pr[s][rank % P] for s in full]
            pk = _predicted(p)
            row[f"{name}_ms"] = pk
            row[f"{name}_with"] = inf["priced_with"]
            # the measured cycle (a step's wall time on this rank) over the simulated step
            row[f"{name}_cycle_ratio"] = round(statistics.median(
                meas[s][rank]["cycle"] / pr[s][rank % P]["makespan"] for s in full), 3)
            row[f"{name}_compute_ratio"] = round(mk["compute"] / pk["compute"], 3) if pk["compute"] > 0 else None
        row.update({
            # the schedule's extent (all ranks' forwards and backwards) over the planner's simulated makespan
            "makespan_ratio": round(statistics.median(
                meas[s][rank]["schedule"] / pred[s][rank % P]["makespan"] for s in full), 3),
            "plan_source": "replanned: LookaheadPlanner chained from the initial placement over steps "
                           f"0..{max(full)} of metrics.jsonl with what the run planned with ({info['priced_with']}); "
                           f"op moves match migrated_ops on {info['moves_match']}/{info['steps_checked']} steps",
            "bounds": {str(s): info["bounds"][s] for s in full},
            "baseline": "predicted_ms: the simulator on the replayed plans of the same steps (same run)",
            "loadavg": os.getloadavg()[0],
        })
        rows.append(row)
    return rows


def table(rows: Sequence[dict]) -> str:
    cols = ("forward", "backward", "optimizer", "reduce", "recv_wait", "send", "migrate", "plan", "other", "rest")
    head = f"{'rank':>5} {'':>9} " + " ".join(f"{c[:9]:>9}" for c in cols) + f" {'cycle':>8} {'sched':>8}"
    lines = [head]
    for r in rows:
        m = r["measured_ms"]
        lines.append(f"{r['rank']:>5} {'measured':>9} " + " ".join(f"{m[c]:9.2f}" for c in cols)
                     + f" {m['cycle']:8.2f} {m['schedule']:8.2f}")
        for name, label in (("predicted", "planner"), ("predicted_measured", "measured$")):
            p = r.get(f"{name}_ms")
            if p is not None:
                lines.append(f"{'':>5} {label:>9} " + " ".join(f"{p[c]:9.2f}" for c in cols)
                             + f" {p['makespan']:8.2f} {p['makespan']:8.2f}")
        outside = {k: m[k] for k in cols if k not in COMPUTE_KINDS}
        lines.append(f"{'':>5} outside compute {sum(outside.values()):.2f} ms of {m['cycle']:.2f} "
                     f"({100 * sum(outside.values()) / m['cycle']:.0f} %): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in outside.items() if v >= 0.005))
        lines.append(f"{'':>5} cycle / predicted step: planner {r.get('predicted_cycle_ratio')}, measured costs "
                     f"{r.get('predicted_measured_cycle_ratio')}; compute ratio {r.get('predicted_compute_ratio')}, "
                     f"{r.get('predicted_measured_compute_ratio')}")
    return "\n".join(lines)


def run_job(out: Path, steps: int, trace: Sequence[int], overrides: Sequence[str], nproc: int = 2) -> None:
    """Train ``steps`` steps under torchrun with ``nproc`` stages, tracing ``trace``, into ``out``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", "-m", "search", f"train.steps={steps}",
           "search=none", f"pipeline.trace_steps=[{','.join(map(str, trace))}]", f"hydra.run.dir={out}", *overrides]
    progress("running:", " ".join(cmd))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise TraceReportError(f"the training job failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", type=Path, help="a run directory with trace.json (not with --run)")
    ap.add_argument("--run", action="store_true", help="train a torchrun P = 2 job first (in a temporary directory)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trace", default="40:50", help="traced steps, start:stop (default 40:50)")
    ap.add_argument("--name", default="trace_vs_plan", help="bench/out/<name>.jsonl")
    ap.add_argument("--nproc", type=int, default=2, help="--run: processes")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for --run (key=value)")
    args, extra = ap.parse_known_args(argv)
    overrides = [*(args.overrides or []), *extra]
    if args.run_dir is not None and "=" in str(args.run_dir):
        overrides.insert(0, str(args.run_dir))
        args.run_dir = None
    if args.run:
        a, b = (int(v) for v in args.trace.split(":"))
        run_dir = Path(tempfile.mkdtemp(prefix="pipenas-trace-vs-plan-"))
        run_job(run_dir, args.steps, range(a, b), overrides, args.nproc)
    elif args.run_dir is None:
        ap.error("give a run directory, or --run")
    else:
        run_dir = args.run_dir
    rows = report(run_dir)
    emit(args.name, rows)
    progress(f"{run_dir} ({rows[0]['space']}, steps {rows[0]['steps'][0]}..{rows[0]['steps'][-1]}), "
             "medians in ms per stage:")
    progress(table(rows))
    progress(rows[0]["plan_source"])


if __name__ == "__main__":
    main()
