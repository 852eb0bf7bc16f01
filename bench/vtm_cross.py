"""Issue 22: the tensor manager under cross-subnet schedules on NASPipe's space, simulated.

The space, costs and subnets are issue 15's (``bench/cross_subnet.py``): the transformer preset
``naspipe`` (48 choice layers x 24 candidates, width 1024), micro-batches of 8 x 128 tokens,
analytic costs at 1e14 FLOP/s and 2e12 B/s, an inter-stage link of 100 GB/s; ``--subnets``
archs from the fair sampler, each partitioned by the dynamic planner and chained through the op
owners (ops migrate); shared ops (stem, head) delayed, ``delay = window - 1``. The optimizer
(``--optimizers``): ``sgd`` (issue 15's, momentum: 8 B/param of state) or ``adamw`` (the
transformer preset's, 12 B/param), its update time counted per stage as in issue 15.

Per setting (P, M, over-subscription, optimizer, window):

* **Baseline, same run**: the all-resident cross-subnet schedule of the same subnets and window
  (``pipeline.plan.admission.cross_subnet``, no arena), replayed by ``pipeline.plan.simulate``;
  ``issue15_window``: the window issue 15's rule picks (``cross_subnet.choose``) and the best
  all-resident throughput over the windows run (``over_best_all_resident``).
* **Budget** per stage: ``supernet bytes / (over-subscription x P)``, supernet bytes = weights +
  grads + optimizer state of every op (16 B/param with AdamW, 12 with SGD). Each stage gives it
  to the activations and the arena. Activations hold ``in_flight_bound`` micro-batches (the
  admission's cap, ``P - s``, across subnets); they get all they need to be kept if that leaves
  the arena ``--arena-subnets`` times the stage's largest subnet footprint, else what is left
  (at least the least the activation plan needs: ``pipeline.plan.activations`` then recomputes or
  swaps, its added seconds go into the subnet's backward, its swaps onto the host link), as
  ``bench/vtm.py`` splits a flushed step's budget. The arena holds op state (weights + optimizer
  state: the ``device`` placement, whose fetch moves both), as the runtime's does; the gradients
  of the subnets in flight sit beside it (reserved: at most ``window`` subnets' and at most the
  arena's pinned ops'). Each value of ``--arena-subnets`` is run and the fastest under the first
  variant (Belady, the runtime's default depth) kept (``arena_tried``).
* **Schedule**: ``cross_subnet(..., arena=ArenaBound(arena bytes, state bytes per op))``: a
  subnet begins on a stage only when its ops fit beside those in flight there.
* **Tensor manager** (``pipeline.plan.stage_residency``): per stage, the executor's events over
  the schedule (use order = subnets by their first forward here; pin from the first forward to
  the update; fetch ahead at the start and after each update over ``prefetch_depth + 1`` pending
  subnets past those in flight; an op that moves in lands in the arena when room can be made
  without evicting an op needed sooner, and leaves from it: no host copy either side) decided by
  the runtime's policy objects (``belady`` with the exact future, ``lru``). The copies are
  replayed on each stage's host link (``--links`` bytes/s each way; fetches and write-backs on
  a stream each, as the runtime's CUDA copier issues them): a fetch ahead late for its subnet's
  first forward or a demand fetch is a stall. The arena starts cold (its first fetches are timed).
* **Variants** (:class:`Variant`): what the runtime does (Belady and LRU, ``prefetch_depth`` 2
  and window + 1, ``runtime: true``) and, beside it (``--no-what-ifs`` drops them), the runtime
  before fb3ab5a: one copy stream, moved ops written back by the sender and adopted into a host
  home by the receiver, the horizon counting the subnets in flight.

Per row: throughput over the baseline (``over_all_resident``), hit rate, prefetched and miss
shares, stalls (count of actions that waited, seconds summed over stages, per subnet), the
window, and where the time goes: the schedule with only the activation plan's added time
(``acts_only``), with the arena bound as well but free copies (``bound_no_copies``), then with
copies (the row's figure). ``vtm_cross_verdict`` lines: the issue's targets (>= 0.95 at 4x,
>= 0.85 at 8x, P = 4, M = 4), for the runtime and for the runtime before.

    python bench/vtm_cross.py [--subnets 192] [--oversub 4 8] [--optimizers sgd adamw]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._spawn import emit, progress  # noqa: E402
from bench.cross_subnet import SETTING, Space, build_space, choose, plan_stream  # noqa: E402
from pipeline.plan.activations import CHOICES, PEER, ActivationError, min_activation_memory, plan_activations  # noqa: E402
from pipeline.plan.pairs import gives, pair_of  # noqa: E402
from pipeline.plan.admission import ArenaBound, SubnetWork, cross_subnet, in_flight_bound  # noqa: E402
from pipeline.plan.schedule import Action  # noqa: E402
from pipeline.plan.simulate import HostLinks, simulate  # noqa: E402
from pipeline.plan.stage_residency import StageResidencyError, plan_stage, residency_copies  # noqa: E402
from pipeline.shared import shared_ops_of  # noqa: E402
from search.samplers import make_sampler  # noqa: E402

TARGETS = {4.0: 0.95, 8.0: 0.85}  # over-subscription -> throughput over all-resident (P = 4, M = 4)


class Stream:
    """One stream of subnets on one space: their work, partitions, op origins and move seconds."""

    def __init__(self, space: Space, archs: Sequence, P: int, M: int, eps: float = 0.05) -> None:
        self.space, self.P, self.M = space, P, M
        bounds: list = []
        self.work, self.origin, self.state_time = plan_stream(space, archs, P, M, eps, bounds_out=bounds)
        self.bounds = bounds
        self.actives = [space.graph.active_ops(a) for a in archs]
        self.shared = shared_ops_of(space.graph)

    def schedule(self, work: Sequence[SubnetWork], window: int, arena: ArenaBound | None = None):
        return cross_subnet(work, self.M, window, delayed=self.shared, delay=window - 1, origin=self.origin,
                            state_time=self.state_time, arena=arena)

    def replay(self, sched, work, copies=None, links=None):
        return simulate(sched, work=work, state_time=self.state_time, copies=copies, links=links)


def memory_split(stream: Stream, window: int, oversub: float, arena_subnets: float, link_bw: float,
                 peer_bw: float | None = None) -> dict:
    """Per stage: the budget, the activations' and the arena's shares, and each subnet's
    activation plan (added backward seconds, swapped bytes) under it; ``infeasible`` when the
    arena cannot hold a lone subnet or the activations their floor. ``peer_bw``: the peer tier
    (issue 26, BPipe's pairs s and P - 1 - s) over a link of that many bytes/s each way: a
    holding stage gives its activations all the room the arena's share leaves (not only what its
    own need), and what its own plan leaves of it is what its giver may hand it."""
    space, P, M = stream.space, stream.P, stream.M
    ops, out_bytes = space.table.ops, space.table.out_bytes
    state = {op: c.param_bytes + c.optim_bytes for op, c in ops.items()}  # device placement: travels whole
    grads = {op: c.param_bytes for op, c in ops.items()}
    supernet = sum(state[op] + grads[op] for op in ops)
    budget = supernet / (oversub * P)
    F = in_flight_bound(P, M, window)
    T = len(stream.work)
    ratio = max(grads[op] / state[op] for op in stream.space.stateful if state[op])
    out: dict = {"budget": budget, "state": state, "grads": grads, "capacity": [0] * P, "acts": [0.0] * P,
                 "grads_reserve": [0.0] * P,
                 "added": [[0.0] * T for _ in range(P)], "swap": [[0.0] * T for _ in range(P)],
                 "peer": [[0.0] * T for _ in range(P)], "held_for_pair": [0.0] * P,
                 "recomputed": 0, "swapped": 0, "peered": 0, "op_uses": 0, "peer_bw": peer_bw}
    spare: dict[tuple[int, int], float] = {}  # (holder, subnet) -> bytes its plan leaves its giver
    holders_first = sorted(range(P), key=lambda s: (gives(s, P), s)) if peer_bw else range(P)
    for s in holders_first:
        per = []
        for t, (active, b) in enumerate(zip(stream.actives, stream.bounds)):
            mine = active[b[s]:b[s + 1]]
            costs = [ops[o.op_id] for o in mine]
            inputs = [0] + [out_bytes[active[k - 1].node] for k in range(b[s] + 1, b[s + 1])]
            cut = out_bytes[active[b[s] - 1].node] if b[s] > 0 else out_bytes["input"]
            pinned = sum(state[o] for o in stream.work[t].uses[s])
            keep = F[s] * (sum(c.act_bytes for c in costs) + cut)
            floor = min_activation_memory(costs, inputs, F[s], cut)
            per.append((costs, inputs, cut, pinned, keep, floor))
        largest = max(p[3] for p in per)
        # gradients of the subnets in flight live beside the arena: at most ``window`` subnets' and
        # at most the pinned ops' (which the arena bounds)
        most_grads = window * max(sum(grads[o] for o in w.uses[s]) for w in stream.work)

        def arena_of(rest: float) -> float:  # arena + min(most_grads, ratio x arena) = rest
            return max(rest / (1 + ratio), rest - most_grads)

        goal = arena_subnets * largest
        goal_rest = goal + min(most_grads, ratio * goal)
        holds = peer_bw is not None and gives(pair_of(s, P), P)
        own_need = budget - goal_rest if holds else max(p[4] for p in per)  # a holder lends the rest
        acts = max(min(own_need, budget - goal_rest), max(p[5] for p in per))
        capacity = int(arena_of(budget - acts))
        out["grads_reserve"][s] = budget - acts - capacity
        if capacity < largest:
            return {**out, "infeasible": f"stage {s}: the arena ({capacity / 1e9:.2f} GB) cannot hold its largest "
                                          f"subnet ({largest / 1e9:.2f} GB) beside the activations' floor"}
        out["capacity"][s], out["acts"][s] = capacity, acts
        giver = peer_bw is not None and gives(s, P)
        for t, (costs, inputs, cut, pinned, keep, floor) in enumerate(per):
            out["op_uses"] += len(costs)
            if keep <= acts:
                spare[(s, t)] = acts - keep
                continue
            w = stream.work[t]
            compute = M * (w.fwd[s] + w.bwd[s])
            fetch = sum(state[o] for o in w.uses[s]) / link_bw
            peer = dict(allowed=CHOICES, peer_capacity=spare.get((pair_of(s, P), t), 0.0), peer_bandwidth=peer_bw,
                        peer_overlap=compute) if giver else dict(allowed=tuple(c for c in CHOICES if c != PEER))
            try:
                plan = plan_activations(costs, inputs, F[s], M, acts, link_bw, max(0.0, compute - fetch), cut,
                                        resolution=1 << 20, **peer)
            except ActivationError as e:
                return {**out, "infeasible": str(e)}
            spare[(s, t)] = acts - plan.memory
            out["added"][s][t], out["swap"][s][t], out["peer"][s][t] = plan.added_s, plan.swap_bytes, plan.peer_bytes
            if giver and plan.peer_held:
                r = pair_of(s, P)
                out["held_for_pair"][r] = max(out["held_for_pair"][r], plan.peer_held)
            out["recomputed"] += plan.choices.count("recompute")
            out["swapped"] += plan.choices.count("swap")
            out["peered"] += plan.choices.count(PEER)
    return out


def managed_work(stream: Stream, split: dict) -> list[SubnetWork]:
    """The subnets' work with the activation plan's added seconds in each backward."""
    M = stream.M
    return [SubnetWork(w.uses, w.fwd, tuple(b + split["added"][s][t] / M for s, b in enumerate(w.bwd)), w.send,
                       w.update) for t, w in enumerate(stream.work)]


def in_flight(sched, s: int) -> tuple[float, int]:
    """Mean and most subnets in flight on stage ``s`` when one begins (itself included)."""
    live, seen = set(), []
    for a in sched.actions[s]:
        if a.kind == "F" and a.microbatch == 0:
            live.add(a.subnet)
            seen.append(len(live))
        elif a.kind == "U":
            live.discard(a.subnet)
    return sum(seen) / len(seen), max(seen)


@dataclass(frozen=True)
class Variant:
    """How the tensor manager runs: its policy, ``memory.prefetch_depth`` (an int, or ``w+N``:
    window + N), copy streams (2: fetches beside write-backs, the runtime's copier; 1: one FIFO,
    the runtime before fb3ab5a), where a moved op lands (``device``: in the arena when room can
    be made, the runtime; ``host``: a host home, before) and whether the fetch-ahead horizon
    looks past the subnets in flight (``past``: the runtime) or counts them (``counts``: before)."""

    policy: str = "belady"
    depth: str = "2"
    streams: int = 2
    adopt: str = "device"
    horizon: str = "past"

    @property
    def runtime(self) -> bool:
        """Whether this is what the runtime does now (else the runtime before fb3ab5a)."""
        return self.streams == 2 and self.adopt == "device" and self.horizon == "past"

    @property
    def label(self) -> str:
        return f"{self.policy}/d={self.depth}" + ("" if self.runtime else " (before)")


RUNTIME_VARIANTS = tuple(Variant(p, d) for d in ("2", "w+1") for p in ("belady", "lru"))
# the runtime before fb3ab5a (one copy stream, moved ops through host homes, the horizon counting
# the subnets in flight): the same run's "before" figures
WHAT_IFS = tuple(Variant(p, d, streams=1, adopt="host", horizon="counts") for d in ("2", "w+1")
                 for p in ("belady", "lru"))


def depth_of(spec: str, window: int) -> int:
    """``"2"`` -> 2; ``"w+1"`` -> window + 1 (a horizon that reaches past the subnets in flight)."""
    return window + int(spec[2:] or 0) if spec.startswith("w") else int(spec)


def run_variant(stream: Stream, sched, work, split: dict, v: Variant, window: int, link_bw: float,
                base_s: float, placement: str = "device", host_update: float = 1.5e9, host_limit: bool = False) -> dict:
    """One variant's residency plans over ``sched``, replayed with their copies. ``placement``:
    ``device`` (every op travels with its optimizer state) or ``hybrid`` (the runtime's default:
    the state comes along only where the next subnet on the stage reuses the op, else the host
    steps the op at ``host_update`` parameters/s per stage; :mod:`pipeline.plan.stage_residency`).
    ``host_limit``: the host steps no more of a subnet's ops than it can while the stage computes
    the subnet (M forwards and backwards); the rest keep their state where they fit (the runtime
    with ``memory.host_update_rate``: the placement ``hybrid_rate``)."""
    P, T = stream.P, len(stream.work)
    weights = ({op: c.param_bytes for op, c in stream.space.table.ops.items()} if placement == "hybrid" else None)
    budgets = [{t: 4.0 * host_update * stream.M * (w.fwd[s] + w.bwd[s]) for t, w in enumerate(work)}
               if weights is not None and host_limit else None for s in range(P)]
    plans = [plan_stage(sched, s, split["state"], split["capacity"][s], v.policy, depth_of(v.depth, window), v.adopt,
                        v.horizon == "past", weights, budgets[s]) for s in range(P)]
    # activations out in the forwards, back for the backwards: swaps on the host link, the peer
    # tier's on the peer link
    more = {Action(s, "F", 0, t): (("d2h", split["swap"][s][t]), ("h2d", split["swap"][s][t]),
                                   ("peer_out", split["peer"][s][t]), ("peer_in", split["peer"][s][t]))
            for s in range(P) for t in range(T) if split["swap"][s][t] or split["peer"][s][t]}
    copies = residency_copies(sched, plans, more=more, duplex=v.streams == 2)
    peer = (split["peer_bw"],) * P if split["peer_bw"] else None
    host = (4.0 * host_update,) * P  # bytes of float32 parameters the host steps a second
    r = stream.replay(sched, work, copies, HostLinks((link_bw,) * P, (link_bw,) * P, host, peer_out=peer,
                                                     peer_in=peer))
    on = {"h2d": 0.0, "d2h": 0.0}
    for c in copies:
        if c.channel in on:
            on[c.channel] += c.nbytes
    waits = r.waited or {}
    uses = sum(p.uses for p in plans)
    return {
        "subnets_per_hour": 3600 * T / r.step_time, "makespan_s": r.step_time,
        "over_all_resident": base_s / r.step_time,
        "utilisation": sum(r.busy) / (P * r.step_time),
        "hit_rate": sum(p.hits for p in plans) / uses,
        "prefetched_share": sum(p.prefetched for p in plans) / uses,
        "miss_share": sum(p.misses for p in plans) / uses,
        "arrived_share": sum(p.arrived for p in plans) / uses,
        "host_update_share": sum(p.host_updates for p in plans) / uses,
        "stalls": {"count": len(waits), "first_forwards": sum(a.kind == "F" for a in waits),
                   "after_export": sum(a.kind != "F" for a in waits), "of_first_forwards": P * T,
                   "seconds_all_stages": sum(r.stall), "ms_per_subnet_all_stages": 1e3 * sum(r.stall) / T,
                   "share_of_makespan_worst_stage": max(r.stall) / r.step_time},
        "GB_per_subnet": {"fetched": sum(p.fetched_bytes for p in plans) / T / 1e9,
                          "written_back": sum(p.written_bytes for p in plans) / T / 1e9,
                          "grads_to_host": sum(p.host_bytes for p in plans) / T / 1e9,
                          "activation_swaps_each_way": sum(map(sum, split["swap"])) / T / 1e9},
        "copy_stream_busy_share": {ch: v / link_bw / P / r.step_time for ch, v in on.items() if v},
        "host_busy_share": sum(p.host_bytes for p in plans) / host[0] / P / r.step_time,
        "peak_arena_over_capacity": max(p.peak_bytes / p.capacity for p in plans),
    }


def run_setting(stream: Stream, window: int, oversub: float, link_bw: float, arena_subnets: Sequence[float],
                variants: Sequence[Variant] = RUNTIME_VARIANTS, base: dict | None = None,
                peer_bw: float | None = None, placement: str = "device", host_update: float = 1.5e9,
                host_limit: bool = False) -> dict:
    """Every variant at one (window, over-subscription), with the arena size that is fastest under
    the first variant; the figures of one JSON line per variant (``rows``)."""
    P = stream.P
    if base is None:
        base = baseline(stream, window)
    tried, best = {}, None
    for k in arena_subnets:
        split = memory_split(stream, window, oversub, k, link_bw, peer_bw)
        if "infeasible" in split:
            tried[str(k)] = {"infeasible": split["infeasible"]}
            continue
        work = managed_work(stream, split)
        sched = stream.schedule(work, window, ArenaBound(tuple(split["capacity"]), split["state"]))
        try:
            b = run_variant(stream, sched, work, split, variants[0], window, link_bw, base["makespan_s"], placement,
                            host_update, host_limit)
        except StageResidencyError as e:
            tried[str(k)] = {"infeasible": str(e)}
            continue
        tried[str(k)] = {"over_all_resident": round(b["over_all_resident"], 4)}
        if best is None or b["over_all_resident"] > best[0]:
            best = (b["over_all_resident"], k, split, work, sched)
    common = {"window": window, "delay": window - 1, "oversubscription": oversub, "host_link_GBps": link_bw / 1e9,
              "peer_link_GBps": peer_bw / 1e9 if peer_bw else None, "all_resident": base, "arena_tried": tried}
    if best is None:
        return {**common, "infeasible": True}
    _, k, split, work, sched = best
    acts_only = stream.replay(stream.schedule(work, window), work)
    bound = stream.replay(sched, work)
    inflight = [in_flight(sched, s) for s in range(P)]
    common.update({
        "arena_subnets": k, "budget_per_stage_GB": split["budget"] / 1e9,
        "arena_GB": [round(c / 1e9, 3) for c in split["capacity"]],
        "activations_GB": [round(a / 1e9, 3) for a in split["acts"]],
        "grads_reserve_GB": [round(g / 1e9, 3) for g in split["grads_reserve"]],
        "largest_subnet_state_GB": [round(max(sum(split["state"][o] for o in w.uses[s]) for w in stream.work) / 1e9, 3)
                                    for s in range(P)],
        "recomputed_share": split["recomputed"] / split["op_uses"],
        "swapped_share": split["swapped"] / split["op_uses"],
        "peered_share": split["peered"] / split["op_uses"],
        "held_for_pair_GB": [round(h / 1e9, 3) for h in split["held_for_pair"]],
        "moves_per_subnet": len(sched.rule.moves()) / len(stream.work),
        "subnets_in_flight_mean": [round(m, 2) for m, _ in inflight], "subnets_in_flight_max": [x for _, x in inflight],
        "acts_only_over_all_resident": base["makespan_s"] / acts_only.step_time,
        "bound_no_copies_over_all_resident": base["makespan_s"] / bound.step_time,
    })
    return {**common, "rows": {v: run_variant(stream, sched, work, split, v, window, link_bw, base["makespan_s"],
                                              placement, host_update, host_limit) for v in variants}}


def baseline(stream: Stream, window: int) -> dict:
    """The all-resident cross-subnet schedule of the stream at ``window`` (no arena, no copies)."""
    r = stream.replay(stream.schedule(stream.work, window), stream.work)
    T = len(stream.work)
    return {"makespan_s": r.step_time, "subnets_per_hour": 3600 * T / r.step_time,
            "utilisation": sum(r.busy) / (stream.P * r.step_time)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subnets", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4])
    ap.add_argument("--oversub", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"], choices=["sgd", "adamw"])
    ap.add_argument("--windows", type=int, nargs="*", default=[2, 3],
                    help="windows to run besides the one issue 15's rule picks (delay = window - 1)")
    ap.add_argument("--arena-subnets", type=float, nargs="+", default=[1.8, 1.9, 2.0, 2.25, 2.5, 2.75, 3.0, 4.0],
                    help="the arena gets at least this many times the stage's largest subnet state before the "
                         "activations are kept whole; each is tried (first variant) and the fastest kept")
    ap.add_argument("--no-what-ifs", action="store_true",
                    help="only what the runtime does now (not the runtime before fb3ab5a beside it)")
    ap.add_argument("--links", type=float, nargs="+", default=[25e9], help="host link bytes/s each way, per stage")
    ap.add_argument("--peer-links", type=float, nargs="*", default=[],
                    help="also run with the peer tier (issue 26) over a peer link of these bytes/s each way")
    ap.add_argument("--placements", nargs="+", default=["device", "hybrid", "hybrid_rate"],
                    choices=["device", "hybrid", "hybrid_rate"],
                    help="memory.optimizer: device (every op with its state), hybrid (the runtime's default) or "
                         "hybrid_rate (hybrid with memory.host_update_rate = --host-update)")
    ap.add_argument("--host-update", type=float, default=1.5e9,
                    help="hybrid: parameters the host's optimizer steps a second, per stage (bench/vtm.py's default)")
    args = ap.parse_args(argv)
    P = args.stages
    variants = RUNTIME_VARIANTS + (() if args.no_what_ifs else WHAT_IFS)
    rows = []
    t0 = time.perf_counter()
    for opt in args.optimizers:
        space = build_space(optimizer=opt)
        sampler = make_sampler("fair", space.graph.space(), args.seed)
        archs = [sampler.next() for _ in range(args.subnets)]
        for M in args.microbatches:
            stream = Stream(space, archs, P, M)
            picked = choose(stream.work, M, "delayed", stream.shared, stream.origin, stream.state_time)
            windows = sorted(set(args.windows) | {picked["window"]})
            bases = {w: baseline(stream, w) for w in windows}
            best_base = min(b["makespan_s"] for b in bases.values())
            progress(f"{opt} M={M}: {len(archs)} subnets planned at {time.perf_counter() - t0:.0f} s; issue 15's "
                     f"window {picked['window']}; all-resident utilisation " +
                     ", ".join(f"w={w}: {b['utilisation']:.3f}" for w, b in bases.items()))
            head = {"bench": "vtm_cross", "mode": "simulated", "P": P, "M": M, "sampler": "fair",
                    "shared_ops": "delayed", "optimizer": opt,
                    "issue15_window": picked["window"], "subnets": args.subnets, "seed": args.seed,
                    "space": "transformer naspipe 48x24", "costs": "analytic", "rates": SETTING["rates"],
                    "baseline": "all-resident cross-subnet schedule, same subnets and window, same run"}
            for placement, link_bw, peer_bw, oversub, window in product(args.placements, args.links,
                                                                         [None, *args.peer_links], args.oversub,
                                                                         windows):
                t1 = time.perf_counter()
                res = run_setting(stream, window, oversub, link_bw, args.arena_subnets, variants, bases[window],
                                  peer_bw, placement.removesuffix("_rate"), args.host_update,
                                  placement.endswith("_rate"))
                body = {"placement": placement,
                        "host_update_params_per_s": args.host_update if placement != "device" else None,
                        **{k: v for k, v in res.items() if k != "rows"}}
                if "rows" not in res:
                    rows.append({**head, **body})
                    progress(f"{opt} {placement} M={M} x{oversub:g} w={window}: infeasible")
                    continue
                for v, fig in res["rows"].items():
                    fig["over_best_all_resident"] = best_base / fig["makespan_s"]
                    rows.append({**head, "policy": v.policy, "prefetch_depth": v.depth,
                                 "prefetch_depth_resolved": depth_of(v.depth, window), "copy_streams": v.streams,
                                 "adopt": v.adopt, "horizon": v.horizon, "runtime": v.runtime, **body, **fig})
                progress(f"{opt} {placement} M={M} x{oversub:g} w={window} {link_bw / 1e9:g} GB/s"
                         f"{f' peer {peer_bw / 1e9:g} GB/s' if peer_bw else ''}: "
                         f"{time.perf_counter() - t1:.0f} s, arena x{res['arena_subnets']:g}, "
                         f"acts only {res['acts_only_over_all_resident']:.3f}, "
                         f"bound {res['bound_no_copies_over_all_resident']:.3f}; " +
                         ", ".join(f"{v.label} {f['over_all_resident']:.3f} "
                                   f"(hit {f['hit_rate']:.2f})" for v, f in res["rows"].items()))
    emit("vtm_cross", rows + verdicts(rows, P))
    progress(f"total {time.perf_counter() - t0:.0f} s")


def verdicts(rows: Sequence[dict], P: int) -> list[dict]:
    """The issue's targets (P = 4, M = 4, the first link) per optimizer and over-subscription: the
    best Belady row the runtime would run (and the best what-if) over the windows and prefetch
    depths, against the best all-resident throughput of the windows run (and its own window's)."""
    out = []
    if P != 4 or not rows:
        return out
    link = rows[0]["host_link_GBps"]
    peers = sorted({r.get("peer_link_GBps") for r in rows}, key=lambda g: (g is not None, g or 0.0))
    placements = list(dict.fromkeys(r["placement"] for r in rows))
    for opt, placement, (oversub, goal), runtime, peer in product(sorted({r["optimizer"] for r in rows}), placements,
                                                                  TARGETS.items(), (True, False), peers):
        cand = [r for r in rows if r["optimizer"] == opt and r["oversubscription"] == oversub and r["M"] == 4
                and r.get("policy") == "belady" and r.get("runtime") == runtime and r["host_link_GBps"] == link
                and r.get("peer_link_GBps") == peer and r["placement"] == placement]
        if not cand:
            continue
        r = max(cand, key=lambda r: r["over_best_all_resident"])
        tier = f" with the peer tier ({peer:g} GB/s)" if peer else ""
        out.append({"bench": "vtm_cross_verdict", "optimizer": opt, "placement": placement,
                    "host_update_params_per_s": r["host_update_params_per_s"],
                    "host_link_GBps": link, "peer_link_GBps": peer,
                    "what": f">= {goal}x all-resident at {oversub:g}x over-subscription, P={P}, M=4",
                    "as": ("the runtime" if runtime else "the runtime before fb3ab5a") + tier,
                    "figure": r["over_best_all_resident"], "same_window_figure": r["over_all_resident"],
                    "met": r["over_best_all_resident"] >= goal, "window": r["window"],
                    "prefetch_depth": r["prefetch_depth"], "copy_streams": r["copy_streams"], "adopt": r["adopt"],
                    "horizon": r.get("horizon"),
                    "hit_rate": r["hit_rate"], "host_update_share": r["host_update_share"],
                    "stalls": r["stalls"]["count"],
                    "stall_s": r["stalls"]["seconds_all_stages"]})
    return out


if __name__ == "__main__":
    main()
