"""Issue 9: the virtualized tensor manager on NASPipe's space, simulated (mode ``simulate``).

NASPipe's transformer space (48 choice layers x 24 candidates, width 1024: 3.23 billion
parameters, 51.7 GB of fp32 weights + grads + AdamW moments) with analytic costs
(``pipeline.plan.costs.analytic_costs``) for micro-batches of 8 sequences x 128 tokens, the cost
source of ``bench/naspipe_planner.py`` (its ``SOURCES["analytic"]`` shapes and link), at a stated
device rate: fp32 state with TF32 tensor-core math at an effective ``--flops`` (default 2e14
FLOP/s: about 40 % of an H100 SXM's 495 TFLOP/s dense TF32) and ``--hbm`` (2e12 B/s). 1000
subnets from the app's sampler (``--samplers``: ``uniform`` by default, ``fair``; ``--orders``:
``stream`` as drawn, or ``locality``, ``search.order``) with a fixed seed, one per step, 1F1B,
flushed per step.

Per setting (P, over-subscription, optimizer placement, host link, tokens per step):

* **Split**: the static split of the supernet's mean subnet (every subnet has the same 50 ops in
  node order, so each layer lives on one stage and nothing migrates).
* **Budget**: per stage ``supernet bytes / (over-subscription x P)`` (supernet bytes: 16 B per
  parameter). Each stage gives it to the active ops' grads, to activations (all kept if that
  leaves room for two steps' op state, an op both steps use counted once, else the least the
  activation plan needs) and the rest to op state resident under the residency plan
  (``pipeline.plan.residency``). "Two steps' op state" is the largest pair over the subnets, or
  with ``--arena-quantiles`` a quantile of the pairs (the fastest under Belady is kept).
* **Ceiling** (``--ceiling``): the same steps with op copies free and only the step's weights,
  gradients and activations on the device (:func:`memory_ceiling`): what no placement or policy
  can beat under this split.
* **Optimizer placement** (``pipeline.plan.simulate``'s doc states the physics): ``device``: an
  op travels with its AdamW moments, 12 B/param up per fetch and 12 B/param written back when a
  changed op is evicted; ``host``: 4 B/param of weights up per use, 4 B/param of grads down after
  the step's last backward, the host's AdamW update at ``--host-update`` params/s per stage (the
  next use's fetch waits for it); ``hybrid`` (``pipeline.plan.hybrid``): per op and step, the
  device's way while the next subnet (``--hybrid-gap`` steps) reuses the op, the host's way
  otherwise (the runtime store's rule), and no more host updates per step than the host does in
  an all-resident step's time (``limit_host``: the ops needed again soonest go to the device).
* **Policies**, same run: ``all_resident`` (infinite memory: no copies, every activation kept),
  ``on_demand`` (synchronous fetch at the step's start, LRU), ``lru`` and ``belady`` (prefetch of
  the next step's ops during the current one, LRU or Belady eviction).
* **Timing**: every step is replayed by ``pipeline.plan.simulate`` with the stage's per-micro-
  batch forward/backward sums (plus the activation plan's recompute and exposed swap time), the
  inter-stage link of ``SOURCES["analytic"]`` and the residency plan's copies on the per-stage
  host channels; a fetch that is late for the stage's first forward is a stall. Channel backlogs
  carry over to the next step.

* **Peer tier** (``--peer-links``, issue 26): each setting runs again with the activation planner's
  ``peer`` choice (:mod:`pipeline.plan.activations`: stage ``s`` hands saved activations to stage
  ``P - 1 - s`` over a peer link of its own and gets them back before the backward). A holding
  stage lends what its budget leaves beyond two steps' op state (``peer_lend`` of it) and, per
  subnet, what its own activations leave of their share; it plans its own activations first, its
  giver second (:func:`~pipeline.plan.pairs.pair_plans`). The copies run on the giver's
  ``peer_out`` / ``peer_in`` channels in the replay, one per micro-batch: out after its forward,
  back after the action two before its backward and before that backward (a late one stalls it).
  Each row reports the activation memory per stage (``activation_profile_GB``: keep-all, the
  plan's own, what it holds for its pair) and a ``vtm_peer`` line puts the two rows side by side.

One JSON line per setting. A ``measure`` mode (real copies on a CUDA device, against the same
figures) belongs beside ``simulate`` in :func:`main`; it is not written yet.

    python bench/vtm.py [--subnets 1000] [--seed 0] [--ceiling]   # ~14 min on one core
    python bench/vtm.py --stages 8 --oversub 4 8 --placements hybrid --links 25e9 --sweep-microbatches \
        --peer-links 150e9 --ceiling                                 # issue 26's rows
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import emit, progress  # noqa: E402
from bench.naspipe_planner import SOURCES  # noqa: E402
from pipeline.plan.activations import (  # noqa: E402
    ALL_CHOICES, CHOICES, ActivationError, ActivationPlan, min_activation_memory, plan_activations,
)
from pipeline.plan.pairs import gives, pair_of, pair_plans  # noqa: E402
from pipeline.plan.costs import CostTable, analytic_costs, mean_problem, subnet_problem  # noqa: E402
from pipeline.plan.hybrid import REUSE_NEXT, HybridCosts, limit_host, plan_hybrid, reuse_rule, shed_to_fit  # noqa: E402
from pipeline.plan.partition import ManagedMemory, evaluate, solve  # noqa: E402
from pipeline.plan.residency import ResidencyError, next_use, plan_residency  # noqa: E402
from pipeline.plan.schedule import Action, build as build_schedule, in_flight  # noqa: E402
from pipeline.plan.simulate import Copy, HostLinks, makespan, simulate  # noqa: E402
from pipeline.memory.settings import OPTIMIZER_PLACEMENTS  # noqa: E402
from search.samplers import ORDERS, make_sampler  # noqa: E402
from supernet.spaces import transformer  # noqa: E402

SCHEDULE = "1f1b"
POLICIES = ("on_demand", "lru", "belady")
CFG = SOURCES["analytic"]


@dataclass(frozen=True)
class Space:
    """The supernet, its cost table and the subnets, split into per-stage traces."""

    graph: object
    table: CostTable
    archs: tuple
    actives: tuple  # per subnet, its active ops (50, node order)


def build_space(subnets: int, seed: int, flops: float, hbm: float, overhead: float, sampler: str = "uniform",
                order: str = "stream", graph=None, table: CostTable | None = None) -> Space:
    """NASPipe's space, its cost table (or the ``graph`` and ``table`` given) and ``subnets`` archs
    from the app's sampler (``uniform``: SPOS, ``fair``: FairNAS rounds) in ``order``
    (``locality``: :func:`search.order.locality_order` within each round or block)."""
    if graph is None:
        graph = transformer.build(input_shape=CFG["sample_shape"], num_classes=10, preset="naspipe", layers=48,
                                  width=CFG["width"])
    if table is None:
        table = analytic_costs(graph, CFG["sample_shape"], CFG["microbatch"], "adamw", flops_per_s=flops,
                               bytes_per_s=hbm, overhead_s=overhead)
    stream = make_sampler(sampler, graph.space(), seed, order=order)
    archs = tuple(stream.next() for _ in range(subnets))
    return Space(graph, table, archs, tuple(tuple(graph.active_ops(a)) for a in archs))


def run_setting(space: Space, P: int, M: int, oversub: float, placement: str, link_bw: float,
                host_update: float, policies=POLICIES, hybrid: HybridCosts = REUSE_NEXT,
                ceiling: bool = False, arena_quantile: float = 1.0, peer_link: float | None = None,
                peer_lend: float = 1.0) -> dict:
    """Simulate every policy over the subnets for one setting; the figures of one JSON line
    (with ``ceiling``, also :func:`memory_ceiling`'s).

    ``arena_quantile``: the stage's arena holds that quantile of its two-step op state over the
    subnets (1: the largest pair, so every prefetch has room; below 1 the activations get more
    memory and the pairs over it fetch what does not fit when their step starts); with
    ``hybrid`` a step whose ops do not fit with the state they keep sends state home
    (:func:`~pipeline.plan.hybrid.shed_to_fit`, as the runtime store does).

    ``peer_link`` (bytes/s each way; None: no peer tier): the activation plans may hand saved
    activations to the paired stage (module doc); a holder lends ``peer_lend`` of what its budget
    leaves beyond two steps' op state."""
    if not 0 < arena_quantile <= 1:
        raise ValueError(f"arena_quantile: expected a number in (0, 1], found {arena_quantile!r}")
    table, n = space.table, len(space.actives)
    ops = table.ops
    link = CFG["link"]
    bounds = solve(mean_problem(space.graph, table, num_stages=P, num_microbatches=M, schedule=SCHEDULE,
                                bandwidth=link["bandwidth"], latency=link["latency_s"])).bounds
    F = in_flight(SCHEDULE, P, M)
    supernet_bytes = sum(4 * c.param_bytes for c in ops.values())  # weights, grads, 2 AdamW moments
    budget = supernet_bytes / (oversub * P)
    # per stage and subnet: op ids, and the sums the simulator needs
    ids = [[tuple(a.op_id for a in act[bounds[s]:bounds[s + 1]]) for act in space.actives] for s in range(P)]
    cut = [[table.out_bytes[act[bounds[s] - 1].node] if bounds[s] > 0 else table.out_bytes["input"]
            for act in space.actives] for s in range(P)]
    fwd = np.array([[sum(ops[o].fwd for o in ids[s][t]) for t in range(n)] for s in range(P)])
    bwd = np.array([[sum(ops[o].bwd for o in ids[s][t]) for t in range(n)] for s in range(P)])
    send_b = [table.out_bytes[space.actives[0][bounds[c + 1] - 1].node] for c in range(P - 1)]
    send = [link["latency_s"] + b / link["bandwidth"] for b in send_b]
    schedule = build_schedule(SCHEDULE, P, M)
    step_s = [makespan(schedule, fwd[:, t], bwd[:, t], send) for t in range(n)]  # all-resident, per subnet
    uses = n * 50  # op uses over the stream (NASPipe's subnets run 50 ops)

    # the device copy of an op's state and what a use moves (pipeline.plan.simulate's doc)
    weights = {o: c.param_bytes for o, c in ops.items()}  # 4 B/param
    if placement == "host":
        size = weights
    else:
        size = {o: c.param_bytes + c.optim_bytes for o, c in ops.items()}  # weights + 2 moments: 12 B/param
    # per stage and step, the ops updated on the host (hybrid: pipeline.plan.hybrid from the known future)
    if placement == "hybrid":
        optim = {o: c.optim_bytes for o, c in ops.items()}
        # the host updates at most what it can while a step runs (all-resident step time)
        cap = [step_s[t] * 4 * host_update for t in range(n)]
        hybrid_plans = [limit_host(plan_hybrid(ids[s], weights, optim, hybrid), ids[s], weights, cap)
                        for s in range(P)]
        on_host = [p.on_host for p in hybrid_plans]
    else:
        on_host = [tuple(frozenset(u) if placement == "host" else frozenset() for u in ids[s]) for s in range(P)]

    def use_sizes(s: int) -> list[dict]:
        """Per step of stage ``s``, the device bytes of each op's copy (its weights when updated on the host)."""
        return [{o: weights[o] if o in on_host[s][t] else size[o] for o in ids[s][t]} for t in range(n)]

    use_size = [use_sizes(s) for s in range(P)]
    out: dict = {"budget_per_stage_GB": budget / 1e9, "bounds": list(bounds), "arena_quantile": arena_quantile}

    # memory split per stage: grads of the active ops, activations, then op state
    stages = []
    for s in range(P):
        grads = max(sum(ops[o].param_bytes for o in u) for u in ids[s])
        # this step's op state and the next one's (an op both use is one copy on the device)
        pairs = sorted(sum({**a, **b}.values()) for a, b in zip(use_size[s], use_size[s][1:] + [{}]))
        two_steps = pairs[min(n - 1, math.ceil(arena_quantile * n) - 1)]
        inputs = [[0] + [table.out_bytes[space.actives[t][k - 1].node] for k in range(bounds[s] + 1, bounds[s + 1])]
                  for t in range(n)]
        keep = [F[s] * (sum(ops[o].act_bytes for o in ids[s][t]) + cut[s][t]) for t in range(n)]
        floor = max(min_activation_memory([ops[o] for o in ids[s][t]], inputs[t], F[s], cut[s][t]) for t in range(n))
        acts = max(min(max(keep), budget - grads - two_steps), floor)
        resident = int(budget - grads - acts)
        lend = 0
        if peer_link is not None and not gives(s, P) and pair_of(s, P) != s:  # a holder lends its room
            lend = int(peer_lend * max(0, resident - two_steps))
            resident -= lend
        if placement == "hybrid" and arena_quantile < 1:
            on_host[s] = shed_to_fit(hybrid_plans[s], ids[s], weights, optim, resident).on_host
            use_size[s] = use_sizes(s)
        state = [sum(u.values()) for u in use_size[s]]
        stages.append(dict(grads=grads, acts=acts, resident=resident, keep=keep, inputs=inputs, state=state,
                           floor=floor, two_steps=two_steps, lend=lend))
    if placement == "hybrid":
        out["hybrid"] = {"max_gap": hybrid.max_gap, "hold": hybrid.hold,
                         "host_share": sum(len(h) for st in on_host for h in st) / uses}
    # the partitioner's memory model of the tensor manager (pipeline.plan.partition.ManagedMemory)
    # on the same split: active ops' state + grads, the least activation memory, a step's op
    # state reserved for prefetching
    mm = ManagedMemory("device" if placement == "hybrid" else placement, "auto",
                       reserve=tuple(float(max(st["state"])) for st in stages))
    short = [max(0.0, max(m - budget for m in evaluate(subnet_problem(
        space.graph, act, table, P, M, SCHEDULE, link["bandwidth"], link["latency_s"], (budget,) * P, mm),
        bounds).stage_memory)) for act in space.actives]
    out["partitioner_managed_model"] = {"fits_share": sum(x == 0 for x in short) / n,
                                        "worst_short_MB": max(short) / 1e6}
    out["stage_memory_GB"] = [{k: round(v / 1e9, 3) for k, v in st.items() if k in ("grads", "acts", "resident",
                                                                                      "floor", "two_steps", "lend")}
                              for st in stages]

    # activation plans per stage and subnet (the same for every policy); the link time left to
    # hide swaps is the stage's compute less its op traffic, at worst every op fetched. With the
    # peer tier the pairs plan together (holders first); a peered op's copies are replayed on the
    # giver's peer channels, so its plan's exposed peer time is not added here
    added = np.zeros((P, n))
    swap_bytes = np.zeros((P, n))
    peer_bytes = np.zeros((P, n))  # per micro-batch, each way
    own = np.zeros((P, n))
    held = np.zeros((P, n))
    counts = dict.fromkeys(ALL_CHOICES, 0)
    allowed = ALL_CHOICES if peer_link is not None else CHOICES
    try:
        for t in range(n):
            def plan_one(s: int, allow: tuple[str, ...], capacity: float, t: int = t) -> ActivationPlan:
                st = stages[s]
                if st["keep"][t] <= st["acts"]:
                    return _kept(ids[s][t], st["keep"][t], st["acts"])
                compute = M * (fwd[s, t] + bwd[s, t])
                overlap = max(0.0, compute - st["state"][t] / link_bw)
                return plan_activations([ops[o] for o in ids[s][t]], st["inputs"][t], F[s], M, st["acts"], link_bw,
                                        overlap, cut[s][t], allow, resolution=1 << 20, peer_capacity=capacity,
                                        peer_bandwidth=peer_link or math.inf, peer_overlap=M * fwd[s, t])

            plans = pair_plans(P, [st["acts"] + st["lend"] for st in stages], allowed, plan_one)
            for s, plan in enumerate(plans):
                added[s, t] = plan.added_s - plan.exposed_peer_s
                swap_bytes[s, t], peer_bytes[s, t] = plan.swap_bytes, plan.peer_bytes / M
                own[s, t], held[s, t] = plan.memory, plan.held_for_pair
                for c in plan.choices:
                    counts[c] += 1
    except ActivationError as e:
        return {**out, "infeasible": str(e), "short_by_bytes": e.short_by}
    out["activations"] = {"kept_share": counts["keep"] / uses, "recomputed_share": counts["recompute"] / uses,
                          "swapped_share": counts["swap"] / uses, "peered_share": counts["peer"] / uses,
                          "added_ms_per_step_max_stage": 1e3 * float(added.max(axis=0).mean())}
    keep_all = np.array([st["keep"] for st in stages], dtype=float)
    out["activation_profile_GB"] = {  # per stage, mean over the subnets
        "keep_all": [round(float(v) / 1e9, 3) for v in keep_all.mean(axis=1)],
        "own": [round(float(v) / 1e9, 3) for v in own.mean(axis=1)],
        "held_for_pair": [round(float(v) / 1e9, 3) for v in held.mean(axis=1)],
        "device": [round(float(v) / 1e9, 3) for v in (own + held).mean(axis=1)],
        "device_max": [round(float(v) / 1e9, 3) for v in (own + held).max(axis=1)],
    }

    # all-resident: infinite memory, no copies, every activation kept
    base = sum(step_s)
    out["all_resident"] = {"subnets_per_hour": 3600 * n / base, "step_ms": 1e3 * base / n}
    if ceiling:
        out["ceiling"] = memory_ceiling(schedule, F, M, budget, ids, ops, stages, cut, fwd, bwd, send, base, link_bw,
                                        peer_link)
    for policy in policies:
        try:
            plans = [plan_residency(ids[s], size, stages[s]["resident"], policy, prefetch_depth=1,
                                    on_host=on_host[s], host_sizes=weights) for s in range(P)]
        except ResidencyError as e:
            out[policy] = {"infeasible": str(e), "short_by_bytes": e.short_by}
            continue
        out[policy] = _replay(schedule, P, M, n, ids, ops, size, plans, fwd, bwd + added / M, send, swap_bytes,
                              placement, on_host, link_bw, host_update, peer_bytes, peer_link)
    for policy in policies:
        if "subnets_per_hour" in out.get(policy, {}):
            out[policy]["over_all_resident"] = out[policy]["subnets_per_hour"] / out["all_resident"]["subnets_per_hour"]
            if "subnets_per_hour" in out.get("on_demand", {}):
                out[policy]["over_on_demand"] = out[policy]["subnets_per_hour"] / out["on_demand"]["subnets_per_hour"]
    return out


def best_arena(quantiles, space: Space, P: int, M: int, oversub: float, placement: str, link_bw: float,
               host_update: float, policies=POLICIES, hybrid: HybridCosts = REUSE_NEXT, ceiling: bool = False,
               peer_link: float | None = None, peer_lends=(1.0,)) -> dict:
    """:func:`run_setting` with the arena quantile (and, with a peer link, the share a holder
    lends) whose Belady replay is fastest (one choice: that one), the others' throughput over
    all-resident beside it (``arena_quantile_tried``, ``peer_lend_tried``)."""
    setting = (space, P, M, oversub, placement, link_bw, host_update)
    lends = tuple(peer_lends) if peer_link is not None else (1.0,)
    combos = [(q, lend) for q in quantiles for lend in lends]
    if len(combos) == 1:
        q, lend = combos[0]
        return run_setting(*setting, policies, hybrid, ceiling, arena_quantile=q, peer_link=peer_link, peer_lend=lend)
    tried = {}
    for q, lend in combos:
        b = run_setting(*setting, ("belady",), hybrid, arena_quantile=q, peer_link=peer_link,
                        peer_lend=lend).get("belady", {})
        tried[(q, lend)] = b.get("over_all_resident")  # None: infeasible
    best = max((c for c in combos if tried[c] is not None), key=lambda c: (tried[c], c), default=combos[0])
    out = run_setting(*setting, policies, hybrid, ceiling, arena_quantile=best[0], peer_link=peer_link,
                      peer_lend=best[1])
    if len(quantiles) > 1:
        out["arena_quantile_tried"] = {str(q): None if tried[(q, best[1])] is None else round(tried[(q, best[1])], 4)
                                       for q in quantiles}
    if peer_link is not None:
        out["peer_lend"] = best[1]
        out["peer_lend_tried"] = {str(lend): None if tried.get((best[0], lend)) is None
                                  else round(tried[(best[0], lend)], 4) for lend in lends}
    return out


def memory_ceiling(schedule, F, M, budget, ids, ops, stages, cut, fwd, bwd, send, base, link_bw,
                   peer_link: float | None = None) -> dict:
    """What no optimizer placement or eviction policy can beat under this split and budget: op
    copies free and instant, and the stage holding, besides the step's gradients and activations,
    only the weights of the ops it computes (4 B/param: nothing fetched ahead, every optimizer
    state away). The activations get the rest of the budget, step by step, with the whole host
    link to themselves (swaps hide behind all of the stage's compute); the activation plan's
    recompute and exposed swap time is what is left of the all-resident throughput. With
    ``peer_link`` the pairs plan together (a holder's room left is its giver's), peer copies
    hiding behind the stage's compute as swaps do."""
    P, n = fwd.shape
    added = np.zeros((P, n))
    allowed = ALL_CHOICES if peer_link is not None else CHOICES
    for t in range(n):
        acts = [budget - 2 * sum(ops[o].param_bytes for o in ids[s][t]) for s in range(P)]  # weights and grads

        def plan_one(s: int, allow: tuple[str, ...], capacity: float, t: int = t) -> ActivationPlan:
            st = stages[s]
            if st["keep"][t] <= acts[s]:
                return _kept(ids[s][t], st["keep"][t], acts[s])
            compute = M * (fwd[s, t] + bwd[s, t])
            return plan_activations([ops[o] for o in ids[s][t]], st["inputs"][t], F[s], M, acts[s], link_bw, compute,
                                    cut[s][t], allow, resolution=1 << 20, peer_capacity=capacity,
                                    peer_bandwidth=peer_link or math.inf, peer_overlap=compute)

        try:
            plans = pair_plans(P, acts, allowed, plan_one)
        except ActivationError as e:
            return {"infeasible": str(e), "short_by_bytes": e.short_by}
        added[:, t] = [p.added_s for p in plans]
    total = sum(makespan(schedule, fwd[:, t], bwd[:, t] + added[:, t] / M, send) for t in range(n))
    return {"subnets_per_hour": 3600 * n / total, "over_all_resident": base / total,
            "assumes": "op copies free; only the step's weights, gradients and activations on the device; "
                       "the host link carries swaps alone"}


def _kept(op_ids, keep: int, budget: float) -> ActivationPlan:
    """The plan of a stage whose every activation fits: keep them all."""
    return ActivationPlan(tuple(op_ids), ("keep",) * len(op_ids), int(keep), float(budget), 0.0, 0, 0.0, 0.0)


def _peer_copies(schedule, s: int, nbytes: float) -> list[Copy]:
    """Stage ``s``'s peer copies of one step: micro-batch ``m``'s activations out after its
    forward, back after the action two before its backward (the buffer of the backward before
    it is free by then) and before that backward."""
    row = schedule.actions[s]
    out = []
    for i, a in enumerate(row):
        if a.kind == "F":
            out.append(Copy(s, "peer_out", nbytes, after=a, label=f"peer out {a.microbatch}"))
    sent = {c.after.microbatch: k for k, c in enumerate(out)}
    for i, a in enumerate(row):
        if a.kind == "B":
            out.append(Copy(s, "peer_in", nbytes, after=row[i - 2] if i >= 2 else None, before=a,
                            waits_for=(sent[a.microbatch],), label=f"peer in {a.microbatch}"))
    return out


def _replay(schedule, P, M, n, ids, ops, size, plans, fwd, bwd, send, swap_bytes, placement, on_host, link_bw,
            host_update, peer_bytes=None, peer_link: float | None = None) -> dict:
    """Replay the steps with the residency plans' copies on the host channels (``on_host[s][t]``:
    the ops whose update step ``t`` runs on stage ``s``'s host) and the peer tier's on the peer
    channels (``peer_bytes[s, t]``: per micro-batch, each way)."""
    peer = (peer_link,) * P if peer_link is not None else None
    links = HostLinks((link_bw,) * P, (link_bw,) * P, (4 * host_update,) * P, peer_out=peer, peer_in=peer)
    future = [next_use(ids[s]) for s in range(P)]
    channels = ("h2d", "d2h", "host") + (("peer_out", "peer_in") if peer else ())
    free = {ch: (0.0,) * P for ch in channels}
    host_done: dict[str, float] = {}  # op -> absolute time its last host update ends
    clock = total = stall = 0.0
    moved = {ch: 0.0 for ch in ("h2d", "d2h", "peer_out") if ch in channels}
    stalls = []
    for t in range(n):
        copies: list[Copy] = []
        for s in range(P):
            st = plans[s].steps[t]
            first, last = Action(s, "F", 0), Action(s, "B", M - 1)
            if st.prefetched:  # fetched during the step before: the h2d backlog ends when they have landed
                copies.append(Copy(s, "h2d", 0.0, before=first, label="prefetched"))
            wb = {}
            for op in st.writeback:  # changed ops evicted this step go home first
                wb[op] = len(copies)
                copies.append(Copy(s, "d2h", size[op], ready=0.0, label=f"writeback {op}"))
            victims = dict(st.evicted_for)

            def fetch(op: str, before: Action | None, u: int) -> Copy:
                ready = host_done.get(op, -math.inf) - clock if placement != "device" else 0.0  # after its host update
                nbytes = ops[op].param_bytes if op in on_host[s][u] else size[op]
                return Copy(s, "h2d", nbytes, ready=max(ready, 0.0) if before is None else ready, before=before,
                            waits_for=tuple(wb[v] for v in victims.get(op, ()) if v in wb), label=op)

            copies.extend(fetch(op, first, t) for op in st.misses)
            if swap_bytes[s, t]:  # activations out during the forwards, back before the backwards
                copies.append(Copy(s, "d2h", swap_bytes[s, t], ready=0.0, after=first, label="swap out"))
                copies.append(Copy(s, "h2d", swap_bytes[s, t], ready=0.0, after=first, label="swap in"))
            copies.extend(fetch(op, None, t + 1) for op in st.prefetch)
            if peer_bytes is not None and peer_bytes[s, t]:
                base = len(copies)
                copies.extend(dataclasses.replace(c, waits_for=tuple(base + w for w in c.waits_for))
                              for c in _peer_copies(schedule, s, float(peer_bytes[s, t])))
            # ops updated on the host, soonest needed first: grads down after the last backward,
            # then the host's update (the next use's fetch waits for it)
            for op in sorted(st.dropped, key=lambda o: (future[s].after(o, t + 1), o)):
                copies.append(Copy(s, "d2h", ops[op].param_bytes, after=last, label="grads"))
                copies.append(Copy(s, "host", ops[op].param_bytes, waits_for=(len(copies) - 1,), label=op))
        links = dataclasses.replace(links, **{f"{ch}_free_at": free[ch] for ch in channels})
        r = simulate(schedule, fwd[:, t], bwd[:, t], send, copies=copies, links=links)
        for cs in r.copies:
            if cs.copy.channel in moved:
                moved[cs.copy.channel] += cs.copy.nbytes
            if cs.copy.channel == "host":
                host_done[cs.copy.label] = clock + cs.end
        stalls.append(max(r.stall))
        stall += sum(r.stall)
        free = {ch: tuple(f - r.step_time for f in r.free_at[ch]) for ch in channels}
        clock += r.step_time
        total += r.step_time
    plan_hits = sum(p.hits for p in plans)
    plan_uses = sum(p.uses for p in plans)
    return {
        "subnets_per_hour": 3600 * n / total, "step_ms": 1e3 * total / n,
        "hit_rate": plan_hits / plan_uses,
        "prefetched_share": sum(p.prefetched for p in plans) / plan_uses,
        "miss_share": sum(p.misses for p in plans) / plan_uses,
        "MB_moved_per_subnet": {ch: v / n / 1e6 for ch, v in moved.items()},
        "stall_ms_per_step_max_stage": 1e3 * float(np.mean(stalls)),
        "stall_ms_per_step_all_stages": 1e3 * stall / n,
        "peak_resident_GB": max(p.peak_bytes for p in plans) / 1e9,
    }


def peer_line(host: dict, peer: dict, target: float = 0.90) -> dict:
    """The ``vtm_peer`` line of one setting: Belady over all-resident without and with the peer
    tier (the row without it is the baseline, same run), the ceilings, and the activation memory
    per stage before (without) and after (with; what a stage holds for its pair included)."""
    def fig(r: dict, key: str) -> float | None:
        return r.get(key, {}).get("over_all_resident")

    before, after = fig(host, "belady"), fig(peer, "belady")
    return {
        "bench": "vtm_peer", **{k: host[k] for k in ("sampler", "order", "P", "M", "tokens_per_step",
                                                     "oversubscription", "placement", "host_link_GBps")},
        "peer_link_GBps": peer["peer_link_GBps"], "belady_over_all_resident": {"host": before, "host+peer": after},
        "gain": None if before is None or after is None else after - before,
        "never_below": None if before is None or after is None else after >= before - 1e-9,
        "ceiling_over_all_resident": {"host": fig(host, "ceiling"), "host+peer": fig(peer, "ceiling")},
        "target": target, "target_met": None if after is None else after >= target,
        "activations": {"host": host.get("activations"), "host+peer": peer.get("activations")},
        "activation_profile_GB": {"keep_all": host.get("activation_profile_GB", {}).get("keep_all"),
                                  "before": host.get("activation_profile_GB", {}).get("device"),
                                  "after": peer.get("activation_profile_GB", {}).get("device"),
                                  "after_held_for_pair": peer.get("activation_profile_GB", {}).get("held_for_pair")},
        "lent_GB": [st.get("lend") for st in peer.get("stage_memory_GB", [])],
        "peer_lend": peer.get("peer_lend"), "peer_lend_tried": peer.get("peer_lend_tried"),
        "baseline": "the same setting without the peer tier, same run",
    }


def hide_threshold(rows: list[dict], share: float = 0.02) -> list[dict]:
    """Per (P, over-subscription, placement, link): the fewest tokens per step from which Belady's
    stalls stay within ``share`` of the all-resident step at every larger size swept."""
    out = []
    keys = sorted({(r["P"], r["oversubscription"], r["placement"], r["host_link_GBps"]) for r in rows})
    for key in keys:
        pts = sorted((r["tokens_per_step"], r["belady"]["stall_ms_per_step_max_stage"] / r["all_resident"]["step_ms"],
                      r["belady"]["over_all_resident"])
                     for r in rows if (r["P"], r["oversubscription"], r["placement"], r["host_link_GBps"]) == key
                     and "stall_ms_per_step_max_stage" in r.get("belady", {}))
        hidden = None
        for tokens, stall, _ in reversed(pts):
            if stall > share:
                break
            hidden = tokens
        out.append({"bench": "vtm_hide_threshold", "P": key[0], "oversubscription": key[1], "placement": key[2],
                     "host_link_GBps": key[3], "stall_share_limit": share, "hidden_from_tokens_per_step": hidden,
                     "sweep": [{"tokens_per_step": t, "stall_share": round(st, 4),
                                "belady_over_all_resident": round(x, 4)} for t, st, x in pts]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["simulate", "measure"], default=None,
                    help="simulate (analytic costs, the default) or measure: real runs of the app with the tensor "
                         "manager against all-resident (bench/vtm_cpu.py; further options go to it)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="measure on this device; --device cuda implies --mode measure (host<->device bandwidth, "
                         "stall time, torch.cuda.max_memory_allocated against the budget)")
    ap.add_argument("--subnets", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--oversub", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--placements", nargs="+", default=["device", "host", "hybrid"],
                    choices=list(OPTIMIZER_PLACEMENTS))
    ap.add_argument("--hybrid-gap", type=int, default=1,
                    help="hybrid: an op's state stays on the device while its next use is at most this many steps away")
    ap.add_argument("--naspipe-microbatches", type=int, nargs="+", default=[8, 16],
                    help="NASPipe's batch as bench/naspipe_planner.py runs it (micro-batches of 8 x 128 tokens): "
                         "every policy, at every link")
    ap.add_argument("--sweep-microbatches", type=int, nargs="*", default=[2, 4, 32],
                    help="the rest of the tokens-per-step sweep: Belady and all-resident, first link only")
    ap.add_argument("--links", type=float, nargs="+", default=[25e9, 12e9], help="host link bytes/s each way")
    ap.add_argument("--flops", type=float, default=2e14)
    ap.add_argument("--hbm", type=float, default=2e12)
    ap.add_argument("--overhead", type=float, default=1e-5)
    ap.add_argument("--host-update", type=float, default=1.5e9, help="host AdamW parameters/s per stage")
    ap.add_argument("--samplers", nargs="+", default=["uniform"], choices=["uniform", "fair"],
                    help="the app's samplers the subnets come from (sampler.name)")
    ap.add_argument("--orders", nargs="+", default=["stream"], choices=list(ORDERS),
                    help="sampler.order: as drawn, or locality-aware within each fair round / block of draws")
    ap.add_argument("--arena-quantiles", type=float, nargs="+", default=[1.0],
                    help="size each stage's arena at these quantiles of its two-step op state (run_setting's "
                         "arena_quantile); with several, each is replayed under Belady and the fastest kept")
    ap.add_argument("--peer-links", type=float, nargs="*", default=[],
                    help="peer link bytes/s each way (issue 26): each setting runs again with the activation "
                         "planner's peer tier at each, beside the row without it")
    ap.add_argument("--peer-lends", type=float, nargs="+", default=[1.0, 0.5, 0.0],
                    help="with a peer link: the shares of its room beyond two steps' op state a holding stage "
                         "lends its pair; each is replayed under Belady and the fastest kept")
    ap.add_argument("--peer-target", type=float, default=0.90,
                    help="the Belady/all-resident figure the peer rows are checked against at 8x")
    ap.add_argument("--ceiling", action="store_true",
                    help="also the memory ceiling per setting (memory_ceiling: copies free, only the step's "
                         "weights, gradients and activations on the device)")
    args, rest = ap.parse_known_args()
    if args.mode == "measure" or (args.mode is None and args.device is not None):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import vtm_cpu

        vtm_cpu.main(["--device", args.device or "cpu", *rest])
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    t0 = time.perf_counter()
    built = build_space(args.subnets, args.seed, args.flops, args.hbm, args.overhead, args.samplers[0],
                        args.orders[0])
    spaces = {(sm, od): built if (sm, od) == (args.samplers[0], args.orders[0]) else
              build_space(args.subnets, args.seed, args.flops, args.hbm, args.overhead, sm, od, built.graph,
                          built.table)
              for sm in args.samplers for od in args.orders}
    progress(f"cost table and {args.subnets} subnets x {len(spaces)} streams in {time.perf_counter() - t0:.1f} s")
    runs = []  # (P, oversub, placement, link, M, policies)
    for link_bw in args.links:
        first = link_bw == args.links[0]
        for M in sorted(set(args.naspipe_microbatches) | (set(args.sweep_microbatches) if first else set())):
            nas = M in args.naspipe_microbatches
            policies = POLICIES if nas and first else ("on_demand", "belady") if nas else ("belady",)
            runs += [(P, o, pl, link_bw, M, policies) for P in args.stages for o in args.oversub
                     for pl in args.placements]
    rows, pairs = [], []
    for (sampler, order), space in spaces.items():
        for P, oversub, placement, link_bw, M, policies in runs:
            tier_rows = []
            for peer_link in [None, *args.peer_links]:
                t1 = time.perf_counter()
                res = best_arena(args.arena_quantiles, space, P, M, oversub, placement, link_bw, args.host_update,
                                 policies, reuse_rule(args.hybrid_gap), ceiling=args.ceiling, peer_link=peer_link,
                                 peer_lends=args.peer_lends)
                b = res.get("belady", {})
                tier = "host" if peer_link is None else f"host+peer {peer_link / 1e9:g} GB/s"
                progress(f"{sampler}/{order} P={P} x{oversub:g} {placement} {link_bw / 1e9:g} GB/s M={M} {tier}: "
                         f"{time.perf_counter() - t1:.1f} s, belady/all-resident "
                         f"{b.get('over_all_resident', float('nan')):.3f}, "
                         f"/on-demand {b.get('over_on_demand', float('nan')):.3f}")
                tier_rows.append({
                    "bench": "vtm", "mode": args.mode, "sampler": sampler, "order": order, "P": P, "M": M,
                    "tokens_per_step": M * CFG["microbatch"] * CFG["sample_shape"][0],
                    "naspipe_batch": M in args.naspipe_microbatches,
                    "oversubscription": oversub, "placement": placement, "host_link_GBps": link_bw / 1e9,
                    "peer_link_GBps": None if peer_link is None else peer_link / 1e9,
                    "flops_per_s": args.flops, "hbm_bytes_per_s": args.hbm, "overhead_s": args.overhead,
                    "host_update_params_per_s": args.host_update, "subnets": args.subnets, "seed": args.seed,
                    "schedule": SCHEDULE, **res,
                    "baseline": "all_resident (infinite memory), on_demand and lru, same run",
                })
            rows += tier_rows
            pairs += [peer_line(tier_rows[0], r, args.peer_target) for r in tier_rows[1:]]
    rows += hide_threshold([r for r in rows if r["host_link_GBps"] == args.links[0] / 1e9
                            and r["peer_link_GBps"] is None
                            and (r["sampler"], r["order"]) == (args.samplers[0], args.orders[0])])
    rows += pairs
    progress(f"total {time.perf_counter() - t0:.0f} s")
    emit("vtm", rows)


if __name__ == "__main__":
    main()
