"""Issue 15: cross-subnet pipelining on NASPipe's space, simulated (``--mode simulated``).

The space and costs are ``bench/naspipe_planner.py``'s ``analytic`` source: the transformer
preset ``naspipe`` (48 choice layers x 24 candidates, width 1024), micro-batches of 8 sequences
of 128 tokens, analytic costs at GPU-like rates (1e14 FLOP/s, 2e12 B/s, 10 us per op), an
NVLink-like link (100 GB/s, 10 us). For each (P, M, sampler) a stream of ``--subnets`` archs
from the project's sampler (``search.samplers.make_sampler``, ``uniform`` or ``fair``) is
partitioned subnet by subnet by the dynamic planner, chained through the op owners as the
runtime does (``pipeline.plan.placement``: initial owners, each plan's moves; the plan of a
subnet sees where its ops are after the plans before it). Each subnet becomes a
:class:`~pipeline.plan.admission.SubnetWork`: per stage its ops with state (parameters or
buffers; identity/zero/sum have none) and the sums of their forward and backward seconds; per
cut the link's latency + the cut's bytes / bandwidth; per stage the SGD update, one optimizer
call over the stage's ops as the runtime makes (weights, grads and momentum read, weights and
momentum written: 5 x the parameter bytes at 2e12 B/s, + 10 us). An op's move takes the link
latency + its weights and optimizer state / bandwidth.

The cross-subnet schedule of the whole stream (``pipeline.plan.admission.cross_subnet``) is
replayed by the simulator (``pipeline.plan.simulate``) beside today's flushed 1F1B on the same
stream, same costs (``cross_subnet`` with window 1: each subnet drained before the next, its
moves after the update before):

* ``utilisation``: busy / (P x makespan) of the cross-subnet schedule (busy: forwards, backwards
  and updates); ``flush_bound``: the same of the flushed schedule; ``over_flush``: throughput of
  cross over flushed (flushed makespan / cross makespan, the same subnets);
  ``flush_1f1b_utilisation``: the flushed step in 1F1B's literal order per subnet (what the
  runtime runs today; ``flush_bound`` lets a stage run a ready backward first).
* shared ops (``shared_ops``): the graph's fixed ops, ``stem`` and ``head``, which every subnet
  runs: ``exact`` (read after the previous subnet's update), ``delayed`` (read ``delay`` updates
  late), ``frozen`` (NASPipe's choice: never updated). ``window`` and ``delay`` per row: the
  smallest of a grid that meets the row's target utilisation (0.90 / 0.85 at P = 4 / 8 with
  M = 1, 0.95 with M = 4), else the best of the grid, which stops where utilisation stops
  growing (``choice`` says which; ``grid`` lists what was tried). ``--shared-delays head=1``
  gives a shared op its own delay in the main delayed rows (``pipeline.shared_delays``; the row
  names them in ``shared_delays``): what reading the head sooner costs the schedule.
* ``naspipe_rule`` rows (uniform sampler): NASPipe's rule, frozen shared ops and a window of 30
  (each stage runs the first non-conflicting subnet of the 30).
* ``cross_subnet_options`` rows (fair/delayed): what two knobs buy, each row with its own
  window and delay from the grid: ``eps`` = 0 (the planner's best balance instead of the
  runtime's 5 % slack for fewer moves: across subnets a move rarely waits) and ``cap`` = 2x
  (twice 1F1B's in-flight micro-batches per stage: twice its activation memory).
* ``per_window_partition`` rows: the fair/delayed setting with one partition per block of
  ``window`` consecutive subnets (the dynamic planner on the block's mean op costs) instead of
  one per subnet, against the per-subnet partitions, same schedule settings.
* ``bw_split`` rows (fair/delayed; issue 23 part 4): the same stream with every backward split
  into ``B`` (input gradient) and ``W`` (weight gradient, placed where a stage would idle;
  activations held until ``W``), window and delay chosen from the grid as above, beside the
  figures without the split (``unsplit_*``) in the same line, for each (eps, cap) of the rows
  above. A weight gradient costs half the backward of an op with parameters (the weight and
  input gradients of a matmul are one matmul each) and nothing for one without (every op of
  this space has parameters). ``flush_bound_split``: window 1 with the split. One more row per
  setting has the runtime's split (``pipeline.schedule=zbh1``): its default cap, ``P`` on every
  stage (ZB-H1's rule: any stage may hold what 1F1B's first one holds), beside the runtime's
  default without the split (1F1B's cap, eps 0.05).
* ``byte_caps`` rows (``--byte-caps``; fair/delayed): the runtime's settings (1F1B's cap without
  the split, ZB-H1's with it, eps 0.05) with each stage's in-flight cap counted in activation
  bytes, the count cap's worst case (``pipeline.plan.admission.ActivationCap.like``: the same
  peak, more micro-batches of the subnets that keep less there), beside the count cap
  (``count_cap_*``, ``over_count_cap``); ``activation_bytes_max_over_mean`` per stage.
* ``clip`` rows (``--clip``; fair/delayed): the runtime's settings (1F1B's cap without the split,
  ZB-H1's with it, eps 0.05) with clipping (``train.clip_grad_norm``: every update waits for
  every stage's last backward of its subnet, ``Schedule.norms``), window and delay from the grid,
  beside the same without (``unclipped_*``, ``over_unclipped``): what the global norm costs.
* ``cross_subnet_verdict`` lines: the issue's targets (fair, delayed), met or missed, per row.
* ``--objective minmax``: every stream partitioned with the planner's other objective
  (``pipeline.objective=minmax``: the fewest moved bytes within ``eps`` of the best slowest stage,
  instead of the step time a better balance saves); each row names its ``objective``.

Real rows (``--mode real``: gloo runs of the app on this machine, P = 2, M = 4, alternating
rounds, the same fields) come from ``bench/cross_subnet_real.py``, which this script runs.

    python bench/cross_subnet.py [--subnets 192] [--seed 0] [--stages 4 8] [--microbatches 1 4]
    python bench/cross_subnet.py --samplers fair --shared-ops delayed     # the issue's targets (bw_split too)
    flock /tmp/pipenas-bench.lock python bench/cross_subnet.py --mode real [--rounds 3] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._spawn import emit, progress  # noqa: E402
from bench.naspipe_planner import SOURCES  # noqa: E402
from pipeline.plan.admission import ActivationCap, SubnetWork, cross_subnet, stage_caps  # noqa: E402
from pipeline.plan.clock import WEIGHT_SHARE  # noqa: E402
from pipeline.plan.costs import CostTable, analytic_costs, mean_cost, subnet_problem  # noqa: E402
from pipeline.plan.partition import OpCost, PartitionProblem, kept_per_microbatch  # noqa: E402
from pipeline.plan.placement import initial_owners, moves  # noqa: E402
from pipeline.plan.planners import DynamicPlanner  # noqa: E402
from pipeline.plan.schedule import Action, Schedule, one_f_one_b  # noqa: E402
from pipeline.plan.simulate import simulate  # noqa: E402
from pipeline.settings import SHARED_MODES  # noqa: E402
from pipeline.shared import read_late, shared_ops_of, stateful_ops  # noqa: E402
from search.samplers import make_sampler  # noqa: E402
from supernet import SupernetGraph  # noqa: E402
from supernet.spaces import transformer  # noqa: E402

SETTING = dict(SOURCES["analytic"], layers=48)  # bench/naspipe_planner.py's analytic source, NASPipe's depth
TARGETS = {(4, 1): 0.90, (8, 1): 0.85}  # (P, M) -> utilisation target; 0.95 with M = 4
NASPIPE_WINDOW = 30
UPDATE_TRAFFIC = {"sgd": 5, "adamw": 7}  # bytes of state read and written per parameter byte, per update


def target(P: int, M: int) -> float:
    return TARGETS.get((P, M), 0.95 if M >= 4 else 0.90)


# ------------------------------------------------------------------------------ the space


class Space:
    """NASPipe's space with its cost table, the ops with state, and their update and move seconds."""

    def __init__(self, graph: SupernetGraph, table: CostTable, link: Mapping[str, float], bytes_per_s: float,
                 overhead_s: float, optimizer: str = "sgd") -> None:
        self.graph, self.table, self.link = graph, table, dict(link)
        self.optimizer = optimizer
        self.stateful = stateful_ops(graph)
        self.shared = frozenset(s.op_id for s in graph.slots() if not graph.is_choice(s.node))
        ops = table.ops
        # SGD with momentum: weights, grads, momentum read; weights, momentum written (one call per
        # stage); AdamW: weights, grads and both moments read, weights and moments written
        traffic = UPDATE_TRAFFIC[optimizer]
        self.update = {op: traffic * c.param_bytes / bytes_per_s for op, c in ops.items()}
        self.update_overhead = overhead_s
        self.move = {op: link["latency_s"] + (c.param_bytes + c.optim_bytes) / link["bandwidth"]
                     for op, c in ops.items()}


def build_space(layers: int = SETTING["layers"], width: int = SETTING["width"],
                microbatch: int = SETTING["microbatch"], sample_shape: tuple[int, ...] = SETTING["sample_shape"],
                rates: Mapping[str, float] = SETTING["rates"], link: Mapping[str, float] = SETTING["link"],
                optimizer: str = "sgd") -> Space:
    graph = transformer.build(input_shape=sample_shape, num_classes=10, preset="naspipe", layers=layers, width=width)
    table = analytic_costs(graph, sample_shape, microbatch, optimizer, **rates)
    return Space(graph, table, link, rates["bytes_per_s"], rates["overhead_s"], optimizer)


# ------------------------------------------------------------------------- the subnets' work


def weight_grad(c: OpCost) -> float:
    """The seconds of an op's weight gradient: :data:`WEIGHT_SHARE` of its backward when it has
    parameters (a matmul's backward is one matmul for the input gradient, one for the weights),
    none without."""
    return WEIGHT_SHARE * c.bwd if c.param_bytes > 0 else 0.0


def subnet_work(space: Space, active, bounds: Sequence[int], problem: PartitionProblem) -> SubnetWork:
    """One subnet's :class:`SubnetWork` under ``bounds`` (the partition of its active ops)."""
    P = len(bounds) - 1
    ops = [space.table.ops[op.op_id] for op in active]
    stage = [range(bounds[s], bounds[s + 1]) for s in range(P)]
    link = space.link
    return SubnetWork(
        uses=tuple(frozenset(active[i].op_id for i in r if active[i].op_id in space.stateful) for r in stage),
        fwd=tuple(sum(ops[i].fwd for i in r) for r in stage),
        bwd=tuple(sum(ops[i].bwd for i in r) for r in stage),
        bwd_weight=tuple(sum(weight_grad(ops[i]) for i in r) for r in stage),
        send=tuple(link["latency_s"] + problem.cut_bytes[bounds[c + 1]] / link["bandwidth"] for c in range(P - 1)),
        update=tuple(space.update_overhead + sum(space.update[active[i].op_id] for i in r
                                                 if active[i].op_id in space.stateful) for r in stage))


def _block_problem(space: Space, actives: Sequence, cut_bytes: Sequence[int], P: int, M: int) -> PartitionProblem:
    """The mean problem of a block of subnets: node by node, the mean of the ops they run there
    (``cut_bytes``: those of the block's first subnet)."""
    ops = tuple(mean_cost(op.node, [space.table.ops[a[k].op_id] for a in actives]) for k, op in enumerate(actives[0]))
    return PartitionProblem(ops, tuple(cut_bytes), P, M, "1f1b", space.link["bandwidth"], space.link["latency_s"])


def plan_stream(space: Space, archs: Sequence, P: int, M: int, eps: float = 0.05,
                block: int | None = None, bounds_out: list | None = None, kept_out: list | None = None,
                objective: str = "step") -> tuple[list[SubnetWork], dict[str, int], dict[str, float]]:
    """Each subnet's work under the dynamic planner's partitions, chained through the op owners
    as the runtime does; with ``block``: one partition per ``block`` consecutive subnets (the
    planner on the block's mean costs). Also each op's stage before the first subnet, and each
    op's move seconds; ``bounds_out`` (a list) receives each subnet's partition bounds, and
    ``kept_out`` its activation bytes per micro-batch and stage (the runtime's ``Plan.kept``:
    ``pipeline.plan.partition.kept_per_microbatch``). ``objective``: the planner's
    (``pipeline.objective``: ``step`` or ``minmax``)."""
    graph, link = space.graph, space.link
    planner = DynamicPlanner(eps, objective=objective)
    owners = initial_owners(graph.slots(), P)
    origin = {op: s for op, s in owners.items() if op in space.stateful}
    actives = [graph.active_ops(a) for a in archs]
    work: list[SubnetWork] = []
    before: frozenset | None = None
    bounds: tuple[int, ...] | None = None
    for k, active in enumerate(actives):
        problem = subnet_problem(graph, active, space.table, P, M, "1f1b", link["bandwidth"], link["latency_s"])
        if block is None:
            bounds = planner.plan(problem, {op.op_id: owners[op.op_id] for op in active}, before).bounds
        elif k % block == 0:
            bounds = planner.plan(_block_problem(space, actives[k:k + block], problem.cut_bytes, P, M)).bounds
        for mv in moves(active, bounds, owners):
            owners[mv.op_id] = mv.dst
        work.append(subnet_work(space, active, bounds, problem))
        if bounds_out is not None:
            bounds_out.append(tuple(bounds))
        if kept_out is not None:
            kept_out.append(kept_per_microbatch(problem, bounds))
        before = frozenset(op.op_id for op in active)
    return work, origin, {op: space.move[op] for op in origin}


# ------------------------------------------------------------------------------ the figures


def _flush_1f1b(work: Sequence[SubnetWork], M: int, origin: Mapping[str, int]) -> Schedule:
    """Today's step: each subnet in 1F1B's literal order, then its update, one subnet after another."""
    P, ref = len(work[0].uses), one_f_one_b(len(work[0].uses), M)
    rows = tuple(tuple(a for t in range(len(work)) for a in (*(Action(s, b.kind, b.microbatch, t) for b in ref.actions[s]),
                                                               Action(s, "U", 0, t)))
                 for s in range(P))
    return Schedule("flush_1f1b", P, M, rows, num_subnets=len(work), uses=tuple(w.uses for w in work),
                    origin=tuple(sorted(origin.items())))


def figures(work: Sequence[SubnetWork], M: int, window: int, mode: str, delay: int, shared: frozenset[str],
            origin: Mapping[str, int], state_time: Mapping[str, float], cap: int | None = 1,
            split: bool = False, delays: Mapping[str, int] | None = None,
            per_microbatch: Sequence[Sequence[int]] | None = None, norms: bool = False) -> dict:
    """Utilisation and makespan of the cross-subnet schedule of ``work``; ``cap``: the in-flight
    cap per stage in multiples of 1F1B's ``P - s`` (None: the builder's default, 1F1B's, or with
    the split ``P`` on every stage); ``split``: every backward split into B and W; ``delays``: a
    shared op's own delay (``pipeline.shared_delays``); ``per_microbatch``: each subnet's
    activation bytes per micro-batch and stage (:func:`plan_stream`'s ``kept_out``): the cap then counts
    bytes, the count cap's worst case (``ActivationCap.like``); ``norms``: every update clips
    (``train.clip_grad_norm``), so it waits for every stage's last backward of its subnet."""
    P = len(work[0].uses)
    late, own = read_late(mode, shared, delay, delays or {})
    counts = stage_caps(P, split) if cap is None else [cap * (P - s) for s in range(P)]
    kw = dict(origin=origin, state_time=state_time, cap=None if cap is None else counts,
              frozen=shared if mode == "frozen" else frozenset(),
              delayed=late, delay=delay if mode == "delayed" else 0, delays=own,
              activations=None if per_microbatch is None else ActivationCap.like(counts, per_microbatch))
    sched = cross_subnet(work, M, window, split=split, norms=norms, **kw)
    r = simulate(sched, work=work, state_time=state_time)
    return {"utilisation": sum(r.busy) / (P * r.step_time), "makespan_s": r.step_time,
            "update_share": sum(sum(w.update) for w in work) / sum(r.busy)}


def flush_figures(work: Sequence[SubnetWork], M: int, origin: Mapping[str, int],
                  state_time: Mapping[str, float]) -> dict:
    """The flushed baselines: ``cross_subnet`` with window 1, and 1F1B's literal order."""
    base = figures(work, M, 1, "exact", 0, frozenset(), origin, state_time)
    lit = simulate(_flush_1f1b(work, M, origin), work=work, state_time=state_time)
    P = len(work[0].uses)
    return {"flush_bound": base["utilisation"], "flush_makespan_s": base["makespan_s"],
            "flush_1f1b_utilisation": sum(lit.busy) / (P * lit.step_time), "flush_1f1b_makespan_s": lit.step_time}


def grid(P: int, M: int, mode: str, subnets: int) -> list[tuple[int, int]]:
    """(window, delay) pairs to try, smallest first: a delay of D lets D + 1 subnets overlap at the
    shared ops' stages, so the window is D + 1 there; exact and frozen rows try windows."""
    if mode == "delayed":
        return [(d + 1, d) for d in (1, 2, 3, 4, 6, 8, 12) if d + 1 <= subnets]
    return [(w, 0) for w in (2, 4, 8, 16, NASPIPE_WINDOW) if w <= subnets]


def choose(work, M: int, mode: str, shared, origin, state_time, cap: int = 1, split: bool = False,
           delays: Mapping[str, int] | None = None, per_microbatch: Sequence[Sequence[int]] | None = None,
           norms: bool = False) -> dict:
    """The smallest (window, delay) of :func:`grid` meeting the row's target, else the best
    (the grid is cut short where utilisation stops growing: twice no gain of 0.002, once for
    exact shared ops, which flush at their stages whatever the window)."""
    P = len(work[0].uses)
    goal, tried, best, flat = target(P, M), [], None, 0
    for window, delay in grid(P, M, mode, len(work)):
        f = figures(work, M, window, mode, delay, shared, origin, state_time, cap, split, delays, per_microbatch,
                    norms)
        tried.append({"window": window, "delay": delay, "utilisation": round(f["utilisation"], 4)})
        if f["utilisation"] >= goal:
            return {"window": window, "delay": delay, **f, "choice": "smallest meeting the target", "grid": tried}
        flat = flat + 1 if best is not None and f["utilisation"] < best[2]["utilisation"] + 0.002 else 0
        if best is None or f["utilisation"] > best[2]["utilisation"] + 1e-9:
            best = (window, delay, f)
        if flat >= (1 if mode == "exact" else 2):
            break
    window, delay, f = best
    return {"window": window, "delay": delay, **f, "choice": "best of the grid (target missed)", "grid": tried}


def row(P: int, M: int, sampler: str, mode: str, picked: dict, flush: dict, subnets: int, seed: int,
        bench: str = "cross_subnet", cap: int = 1, eps: float = 0.05) -> dict:
    return {"bench": bench, "mode": "simulated", "P": P, "M": M, "window": picked["window"], "sampler": sampler,
            "shared_ops": mode, "delay": picked["delay"], "utilisation": picked["utilisation"],
            "cap": f"{cap}x 1F1B (P - s)" if cap is not None else "P on every stage (ZB-H1's rule: the runtime's "
                   "default with the split)", "eps": eps,
            "flush_bound": flush["flush_bound"],
            "over_flush": flush["flush_makespan_s"] / picked["makespan_s"],
            "flush_1f1b_utilisation": flush["flush_1f1b_utilisation"],
            "over_flush_1f1b": flush["flush_1f1b_makespan_s"] / picked["makespan_s"],
            "target_utilisation": target(P, M), "target_met": picked["utilisation"] >= target(P, M),
            "choice": picked.get("choice"), "grid": picked.get("grid"), "update_share": picked["update_share"],
            "subnets": subnets, "seed": seed, "space": "transformer naspipe 48x24", "costs": "analytic",
            "width": SETTING["width"], "microbatch": SETTING["microbatch"], "link": SETTING["link"]}


def split_row(P: int, M: int, sampler: str, stream: tuple, shared: frozenset[str], unsplit: dict, subnets: int,
              seed: int, cap: int, eps: float) -> dict:
    """The ``bw_split`` row of one fair/delayed setting: the grid's choice with every backward
    split, beside ``unsplit`` (the same setting's choice without the split) in the same line."""
    work, origin, state_time, flush = stream
    picked = choose(work, M, "delayed", shared, origin, state_time, cap, split=True)
    bound = figures(work, M, 1, "exact", 0, frozenset(), origin, state_time, split=True)
    r = row(P, M, sampler, "delayed", picked, flush, subnets, seed, bench="bw_split", cap=cap, eps=eps)
    r.update(split=True, flush_bound_split=bound["utilisation"],
             unsplit_utilisation=unsplit["utilisation"], unsplit_window=unsplit["window"],
             unsplit_delay=unsplit["delay"], unsplit_target_met=unsplit["utilisation"] >= target(P, M),
             over_unsplit=unsplit["makespan_s"] / picked["makespan_s"])  # throughput, the same subnets
    return r


def simulated_rows(space: Space, P: int, M: int, sampler: str, subnets: int, seed: int,
                   modes: Sequence[str] = SHARED_MODES, eps: float = 0.05, options: bool = True,
                   bw_split: bool = True, delays: Mapping[str, int] | None = None,
                   byte_caps: bool = False, clip: bool = False, objective: str = "step") -> list[dict]:
    """Every simulated row of one (P, M, sampler): one per shared-op mode (the runtime's planner
    tolerance ``eps``, 1F1B's in-flight cap); NASPipe's rule (uniform); for fair/delayed, the
    options (``cross_subnet_options``: the best balance, eps = 0, and twice 1F1B's cap, i.e.
    twice its activation memory), per-window against per-subnet partitions, and (``bw_split``)
    each of those settings with the B/W split beside it without; (``byte_caps``, fair/delayed)
    the runtime's settings with the in-flight cap counted in activation bytes (``byte_caps`` rows)
    beside the count cap; (``clip``, fair/delayed) the runtime's settings with every update
    waiting for the subnet's gradient norm (``clip`` rows) beside them without. ``objective``: the
    planner's for every partition (each row names it)."""
    s = make_sampler(sampler, space.graph.space(), seed)
    archs = [s.next() for _ in range(subnets)]
    per: list = []  # each subnet's activation bytes per micro-batch and stage (the byte_caps rows)
    work, origin, state_time = plan_stream(space, archs, P, M, eps, kept_out=per, objective=objective)
    shared = shared_ops_of(space.graph)
    flush = flush_figures(work, M, origin, state_time)
    out = []
    picked_delayed = None
    for mode in modes:
        picked = choose(work, M, mode, shared, origin, state_time, delays=delays)
        out.append(row(P, M, sampler, mode, picked, flush, subnets, seed, eps=eps))
        if mode == "delayed" and delays:
            out[-1]["shared_delays"] = dict(delays)
        if mode == "delayed":
            picked_delayed = picked
    if sampler == "uniform":
        f = figures(work, M, NASPIPE_WINDOW, "frozen", 0, shared, origin, state_time)
        out.append(row(P, M, sampler, "frozen", {"window": NASPIPE_WINDOW, "delay": 0, **f,
                                                  "choice": "NASPipe: first non-conflicting subnet of 30"},
                       flush, subnets, seed, bench="naspipe_rule", eps=eps))
    if sampler != "fair" or picked_delayed is None:
        return out
    streams = {eps: (work, origin, state_time, flush)}
    unsplit = {(eps, 1): picked_delayed}  # (eps, cap) -> the grid's choice, fair/delayed, no split
    if options:
        for e, cap in ((0.0, 1), (eps, 2), (0.0, 2)):
            if e not in streams:
                w = plan_stream(space, archs, P, M, e, objective=objective)
                streams[e] = (*w, flush_figures(w[0], M, w[1], w[2]))
            w, o, st, fl = streams[e]
            picked = unsplit[(e, cap)] = choose(w, M, "delayed", shared, o, st, cap)
            out.append(row(P, M, sampler, "delayed", picked, fl, subnets, seed, bench="cross_subnet_options",
                           cap=cap, eps=e))
        # one partition per window of subnets, against one per subnet: same window, delay, cap, eps
        win, d = picked_delayed["window"], picked_delayed["delay"]
        bwork, borigin, bstate = plan_stream(space, archs, P, M, eps, block=win, objective=objective)
        f = figures(bwork, M, win, "delayed", d, shared, borigin, bstate)
        r = row(P, M, sampler, "delayed", {"window": win, "delay": d, **f, "choice": "per-window partition"},
                flush_figures(bwork, M, borigin, bstate), subnets, seed, bench="per_window_partition", eps=eps)
        r["per_subnet_utilisation"] = picked_delayed["utilisation"]
        r["over_per_subnet"] = picked_delayed["makespan_s"] / f["makespan_s"]  # throughput, the same subnets
        out.append(r)
    if bw_split:
        for (e, cap), picked in unsplit.items():
            out.append(split_row(P, M, sampler, streams[e], shared, picked, subnets, seed, cap, e))
        # the runtime's split: its default cap (ZB-H1's rule), beside the runtime without the split
        out.append(split_row(P, M, sampler, streams[eps], shared, unsplit[(eps, 1)], subnets, seed, None, eps))
    # the runtime's caps (1F1B's without the split, ZB-H1's with it), each beside the same without
    # the variant: the delayed choice above, or the grid's choice with the split
    runtime_caps = ((False, 1, unsplit[(eps, 1)]), (True, None, None))
    for split, cap, base in runtime_caps if byte_caps or clip else ():
        base = base or choose(work, M, "delayed", shared, origin, state_time, cap, split=True)
        if byte_caps:
            picked = choose(work, M, "delayed", shared, origin, state_time, cap, split=split, per_microbatch=per)
            r = row(P, M, sampler, "delayed", picked, flush, subnets, seed, bench="byte_caps", cap=cap, eps=eps)
            r.update(split=split, cap=f"{r['cap']}, counted in activation bytes (the count cap's worst case)",
                     count_cap_utilisation=base["utilisation"], count_cap_window=base["window"],
                     over_count_cap=base["makespan_s"] / picked["makespan_s"],  # throughput, the same subnets
                     activation_bytes_max_over_mean=[round(max(r_[k] for r_ in per) * len(per)
                                                           / sum(r_[k] for r_ in per), 3) for k in range(P)])
            out.append(r)
        if clip:
            picked = choose(work, M, "delayed", shared, origin, state_time, cap, split=split, norms=True)
            r = row(P, M, sampler, "delayed", picked, flush, subnets, seed, bench="clip", cap=cap, eps=eps)
            r.update(split=split, unclipped_utilisation=base["utilisation"], unclipped_window=base["window"],
                     unclipped_delay=base["delay"],
                     over_unclipped=base["makespan_s"] / picked["makespan_s"])  # throughput, the same subnets
            out.append(r)
    for r in out:
        r["objective"] = objective
    return out


def verdicts(rows: Sequence[dict]) -> list[dict]:
    """The issue's simulated targets (fair sampler, delayed shared ops), met or missed, with the figure."""
    out = []
    for r in rows:
        if r["bench"] not in ("cross_subnet", "cross_subnet_options", "bw_split", "byte_caps") \
                or r["sampler"] != "fair" or r["shared_ops"] != "delayed":
            continue
        how = {"window": r["window"], "delay": r["delay"], "cap": r["cap"], "eps": r["eps"], "from": r["bench"]}
        split = r["bench"] == "bw_split" or (r["bench"] == "byte_caps" and r["split"])
        if r["bench"] == "bw_split":
            how["without_split"] = r["unsplit_utilisation"]
        if r["bench"] == "byte_caps":
            how["count_cap"] = r["count_cap_utilisation"]
        out.append({"bench": "cross_subnet_verdict", "what": f"utilisation >= {r['target_utilisation']} at "
                    f"P={r['P']}, M={r['M']}" + (" with the B/W split" if split else ""),
                    "figure": r["utilisation"], "met": r["target_met"], **how})
        if (r["P"], r["M"]) == (4, 4) and r["bench"] in ("cross_subnet", "cross_subnet_options"):
            out.append({"bench": "cross_subnet_verdict", "what": "throughput >= 1.5x flushed 1F1B at P=4, M=4",
                        "figure": r["over_flush"], "met": r["over_flush"] >= 1.5,
                        "over_flush_1f1b": r["over_flush_1f1b"], **how})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["simulated", "real"], default="simulated",
                    help="simulated (NASPipe's space, analytic costs) or real (the app under torchrun on this "
                         "machine: bench/cross_subnet_real.py, whose options follow)")
    ap.add_argument("--subnets", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--samplers", nargs="+", default=["uniform", "fair"], choices=["uniform", "fair"])
    ap.add_argument("--shared-ops", nargs="+", default=list(SHARED_MODES), choices=list(SHARED_MODES))
    ap.add_argument("--eps", type=float, default=0.05, help="the dynamic planner's tolerance (pipeline.eps)")
    ap.add_argument("--objective", choices=["step", "minmax"], default="step",
                    help="the dynamic planner's objective (pipeline.objective)")
    ap.add_argument("--no-options", action="store_true", help="skip the eps = 0 / 2x cap / per-window rows")
    ap.add_argument("--no-bw-split", action="store_true", help="skip the bw_split rows (fair, delayed: each "
                    "setting with every backward split into B and W, beside it without)")
    ap.add_argument("--byte-caps", action="store_true", help="add the byte_caps rows (fair, delayed: the "
                    "runtime's caps counted in activation bytes, the count cap's worst case, beside the count cap)")
    ap.add_argument("--clip", action="store_true", help="add the clip rows (fair, delayed: the runtime's caps with "
                    "every update waiting for the subnet's gradient norm, train.clip_grad_norm, beside them without)")
    ap.add_argument("--shared-delays", nargs="*", default=[], metavar="OP=D",
                    help="a shared op's own delay in the delayed rows (pipeline.shared_delays), e.g. head=1")
    args, rest = ap.parse_known_args()
    if args.mode == "real":
        from cross_subnet_real import main as real

        real(rest)
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    delays = {op: int(d) for op, _, d in (kv.partition("=") for kv in args.shared_delays)}
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    space = build_space()
    progress(f"cost table in {time.perf_counter() - t0:.1f} s; {len(space.stateful)} ops with state, "
             f"shared {sorted(space.shared)}")
    rows = []
    for P in args.stages:
        for M in args.microbatches:
            for sampler in args.samplers:
                t0 = time.perf_counter()
                got = simulated_rows(space, P, M, sampler, args.subnets, args.seed, args.shared_ops, args.eps,
                                     not args.no_options, not args.no_bw_split, delays, args.byte_caps, args.clip,
                                     args.objective)
                for r in got:
                    r["loadavg"] = os.getloadavg()[0]
                rows += got
                progress(f"P={P} M={M} {sampler}: {time.perf_counter() - t0:.1f} s; " + ", ".join(
                    f"{r['bench']}/{r['shared_ops']} w={r['window']} d={r['delay']} util {r['utilisation']:.3f} "
                    f"(flush {r['flush_bound']:.3f}, x{r['over_flush']:.2f})" for r in got))
    emit("cross_subnet", rows + verdicts(rows))


if __name__ == "__main__":
    main()
