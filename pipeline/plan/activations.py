"""Activation plans: per active op of a stage, keep its saved activations, swap them, or recompute them.

The schedule fixes how many micro-batches a stage holds between a forward and its backward
(``F = in_flight``: ``min(M, P - s)`` under 1F1B, ``M`` under GPipe; the problem's
``in_flight``, read from its schedule object), so early stages need the most help (BPipe's
observation). Per op, with ``a`` its kept bytes and ``x`` its input's bytes per micro-batch:

======================  ==========================  ============================================
choice                  device bytes                added seconds per step
======================  ==========================  ============================================
``keep``                ``F * a``                   0
``swap``                ``min(F, 2) * a``           the link time ``M * a / host_bandwidth`` (each
                        (one micro-batch going      way) beyond what hides behind compute: all
                        out, one coming back)       swaps share ``overlap`` seconds of idle link
``recompute``           ``F * x`` (the input kept)  ``M * fwd`` (the forward runs again in the
                                                    backward, with the op's derived randomness,
                                                    so the result is the same)
``peer``                ``min(F, 2) * a``, and      the peer link time ``M * a / peer_bandwidth``
                        ``(F - 1) * a`` on the      (each way) beyond what hides behind compute
                        paired stage (below)        (``peer_overlap``), the link's own
======================  ==========================  ============================================

plus ``F * stage_input_bytes`` (the received input, always kept) plus, when any op is recomputed,
the largest recomputed ``a`` (the one micro-batch's activations re-made during its backward;
recomputed ops run their backwards one at a time). The model is conservative where a recomputed
input is also the previous op's kept output (counted twice). :func:`plan_activations` finds the
plan of least added time within the budget exactly: for each cap on the recomputed ``a`` it runs
a dynamic programme over the ops keeping the Pareto front of memory, swapped bytes and recompute
time, pruned by the cost of a greedy plan and of the best plan of the caps searched before
(tests check it against enumeration; ``resolution`` trades exactness for speed). A budget below :func:`min_activation_memory` raises
:class:`ActivationError` with the shortfall.

**The peer tier** (BPipe's pairing, :mod:`pipeline.plan.pairs`): stage ``s`` and stage
``P - 1 - s`` are a pair; under 1F1B the earlier one holds more micro-batches, so it *gives* and
the later one *holds*. A peered op's saved activations go to the pair after
its forward and come back before its backward: the giver keeps one micro-batch going out and
one coming back (as a swap), the pair holds the others, ``(F - 1) * a`` at the giver's peak
(every micro-batch but the one already fetched back). The holder plans its own activations
first; what its budget leaves is the giver's ``peer_capacity`` (``pairs.pair_plans``), so every
stage's memory counts what it holds for its pair (``ActivationPlan.held_for_pair``). The peer
link is its own (``memory.peer_link_bandwidth``), beside the host link, and its copies overlap
compute as swaps do. The exact search keeps the bytes peered as a fourth dimension of its fronts.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .partition import OpCost, Partition, PartitionError, PartitionProblem

__all__ = ["CHOICES", "PEER", "ALL_CHOICES", "ActivationError", "ActivationPlan", "plan_activations",
           "activation_memory", "min_activation_memory", "stage_activation_plan", "stage_activation_floor",
           "op_memory", "peer_held", "partition_activation_plans"]

CHOICES = ("keep", "swap", "recompute")  # what a stage does alone
PEER = "peer"                            # hand them to the paired stage (a giver only)
ALL_CHOICES = CHOICES + (PEER,)
_MIB = float(2**20)


class ActivationError(ValueError):
    """An activation problem is malformed or no plan fits its budget."""

    def __init__(self, message: str, short_by: int | None = None) -> None:
        super().__init__(message)
        self.short_by = short_by


@dataclass(frozen=True)
class ActivationPlan:
    """One stage's choice per op (in op order) and what it costs per step."""

    op_ids: tuple[str, ...]
    choices: tuple[str, ...]
    memory: int            # device bytes of activations at the stage's peak (model above)
    budget: float
    recompute_s: float     # seconds of forwards run again, per step
    swap_bytes: int        # bytes each way over the host link, per step
    exposed_swap_s: float  # swap link time that does not hide behind ``overlap``
    added_s: float         # recompute_s + exposed_swap_s + exposed_peer_s
    peer_bytes: int = 0    # bytes each way over the peer link, per step
    peer_held: int = 0     # bytes the paired stage holds for this one at its peak
    exposed_peer_s: float = 0.0  # peer link time that does not hide behind ``peer_overlap``
    held_for_pair: int = 0  # bytes this stage holds for its pair (set by ``pairs.pair_plans``)

    def choice(self) -> dict[str, str]:
        """``op_id -> "keep" | "swap" | "recompute" | "peer"``."""
        return dict(zip(self.op_ids, self.choices))

    @property
    def device_bytes(self) -> int:
        """What the stage's device holds of activations: its own (``memory``) and its pair's."""
        return self.memory + self.held_for_pair


def peer_held(act_bytes: int, in_flight_: int) -> int:
    """Bytes the paired stage holds for one peered op at the giver's peak: every micro-batch in
    flight but the one fetched back for its backward."""
    return max(in_flight_ - 1, 0) * act_bytes


def op_memory(choice: str, act_bytes: int, input_bytes: int, in_flight_: int) -> int:
    """Device bytes one op's activations take under ``choice``, without the recompute transient
    (the table in the module doc)."""
    if choice == "keep":
        return in_flight_ * act_bytes
    if choice == "swap":
        return min(in_flight_, 2) * act_bytes
    if choice == "recompute":
        return in_flight_ * input_bytes
    if choice == PEER:
        return min(in_flight_, 2) * act_bytes
    raise ActivationError(f"choice: expected one of {list(ALL_CHOICES)}, found {choice!r}")


def activation_memory(ops: Sequence[OpCost], input_bytes: Sequence[int], choices: Sequence[str], in_flight_: int,
                      stage_input_bytes: int = 0) -> int:
    """The device bytes of a stage's activations under the given choices."""
    transient = max((op.act_bytes for op, c in zip(ops, choices) if c == "recompute"), default=0)
    return in_flight_ * stage_input_bytes + transient + sum(
        op_memory(c, op.act_bytes, x, in_flight_) for op, x, c in zip(ops, input_bytes, choices))


def _caps(ops: Sequence[OpCost], allowed: Sequence[str]) -> list[int]:
    """The candidate caps on the recomputed ops' largest ``act_bytes`` (0: nothing recomputed)."""
    return [0] + (sorted({op.act_bytes for op in ops}) if "recompute" in allowed else [])


def _allowed_under(cap: int, op: OpCost, allowed: Sequence[str], F: int = 1,
                   peer_capacity: float = math.inf) -> tuple[str, ...]:
    """The choices op ``op`` may take when no recomputed op keeps more than ``cap`` bytes and the
    pair has ``peer_capacity`` bytes (an op whose share alone exceeds it cannot be peered)."""
    return tuple(c for c in allowed if (c != "recompute" or (cap > 0 and op.act_bytes <= cap))
                 and (c != PEER or peer_held(op.act_bytes, F) <= peer_capacity))


def _peer_savings(saving: Sequence[int], held: Sequence[int], capacity: float) -> int:
    """The most bytes peering saves (0/1 knapsack: op ``k`` saves ``saving[k]`` for ``held[k]``
    of the pair's ``capacity``), exactly, over the front of (held, saved) pairs."""
    front = [(0, 0)]  # (held, saved): held ascending, saved strictly ascending
    for sv, h in zip(saving, held):
        if sv <= 0:
            continue
        grown = sorted(front + [(fh + h, fs + sv) for fh, fs in front if fh + h <= capacity])
        front = []
        for fh, fs in grown:
            if not front or fs > front[-1][1]:
                front.append((fh, fs))
    return front[-1][1]


def min_activation_memory(ops: Sequence[OpCost], input_bytes: Sequence[int], in_flight_: int,
                          stage_input_bytes: int = 0, allowed: Sequence[str] = CHOICES,
                          peer_capacity: float = 0.0) -> int:
    """The least activation memory any plan reaches (with ``peer`` allowed: within the pair's
    ``peer_capacity``)."""
    F = in_flight_
    best = None
    for cap in _caps(ops, allowed):
        own, saving, held = 0, [], []
        for op, x in zip(ops, input_bytes):
            choices = _allowed_under(cap, op, allowed, F, peer_capacity)
            m = min(op_memory(c, op.act_bytes, x, F) for c in choices if c != PEER)
            own += m
            if PEER in choices:
                saving.append(m - op_memory(PEER, op.act_bytes, x, F))
                held.append(peer_held(op.act_bytes, F))
        total = F * stage_input_bytes + cap + own - _peer_savings(saving, held, peer_capacity)
        best = total if best is None else min(best, total)
    return best


def _check(ops: Sequence[OpCost], input_bytes: Sequence[int], in_flight_: int, num_microbatches: int,
           host_bandwidth: float, overlap: float, allowed: Sequence[str], peer_capacity: float,
           peer_bandwidth: float, peer_overlap: float) -> None:
    for k, op in enumerate(ops):
        if not isinstance(op, OpCost):
            raise ActivationError(f"ops[{k}]: expected an OpCost, found {op!r}")
    if len(input_bytes) != len(ops):
        raise ActivationError(f"input_bytes: expected {len(ops)} values (one per op), found {len(input_bytes)}")
    for k, x in enumerate(input_bytes):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ActivationError(f"input_bytes[{k}]: expected a non-negative int (bytes), found {x!r}")
    for name, v in (("in_flight", in_flight_), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ActivationError(f"{name}: expected a positive int, found {v!r}")
    for name, v in (("host_bandwidth", host_bandwidth), ("peer_bandwidth", peer_bandwidth)):
        if not (v > 0):
            raise ActivationError(f"{name}: expected a positive number of bytes/s, found {v!r}")
    for name, v in (("overlap", overlap), ("peer_overlap", peer_overlap)):
        if not (math.isfinite(v) and v >= 0):
            raise ActivationError(f"{name}: expected a finite non-negative number of seconds, found {v!r}")
    if not (peer_capacity >= 0):
        raise ActivationError(f"peer_capacity: expected a non-negative number of bytes, found {peer_capacity!r}")
    bad = [c for c in allowed if c not in ALL_CHOICES]
    if bad or "keep" not in allowed:
        raise ActivationError(f"allowed: expected choices among {list(ALL_CHOICES)} including 'keep', "
                              f"found {list(allowed)}")


@dataclass(frozen=True)
class _Cost:
    """Added seconds per step of (recompute seconds, swapped bytes, peered bytes) per micro-batch."""

    per_byte: float       # host link seconds per swapped byte per micro-batch, each way (M / bandwidth)
    overlap: float
    peer_per_byte: float  # the same over the peer link
    peer_overlap: float

    def exposed(self, swap: float, peer: float) -> tuple[float, float]:
        return (max(0.0, swap * self.per_byte - self.overlap), max(0.0, peer * self.peer_per_byte - self.peer_overlap))

    def added(self, rec: float, swap: float, peer: float) -> float:
        es, ep = self.exposed(swap, peer)
        return rec + es + ep


def plan_activations(
    ops: Sequence[OpCost],
    input_bytes: Sequence[int],
    in_flight_: int,
    num_microbatches: int,
    budget: float,
    host_bandwidth: float = math.inf,
    overlap: float = 0.0,
    stage_input_bytes: int = 0,
    allowed: Sequence[str] = CHOICES,
    resolution: int = 1,
    *,
    peer_capacity: float = 0.0,
    peer_bandwidth: float = math.inf,
    peer_overlap: float = 0.0,
) -> ActivationPlan:
    """The keep/swap/recompute/peer choice per op whose activations fit ``budget`` at the least added time.

    ``ops``: the stage's active ops in order; ``input_bytes[k]``: op ``k``'s input bytes per
    micro-batch (0 for an op whose input is the stage input, kept anyway); ``in_flight_``: micro-
    batches the schedule holds on this stage; ``overlap``: seconds per step the host link is idle
    while the stage computes (swaps up to that hide). ``peer`` (when in ``allowed``): the paired
    stage holds at most ``peer_capacity`` bytes for this one (:func:`peer_held` per op), over a
    link of ``peer_bandwidth`` bytes/s each way, idle ``peer_overlap`` seconds per step. Ties go
    to keeping, then swapping, recomputing, peering. ``resolution`` (bytes): 1 is exact; a
    coarser grain (e.g. 1 MiB) rounds each op's memory, swapped and peered bytes up to it inside
    the search, which bounds the number of states on stages of many ops (the plan still fits:
    its reported memory is exact and at most the rounded one).
    """
    _check(ops, input_bytes, in_flight_, num_microbatches, host_bandwidth, overlap, allowed, peer_capacity,
           peer_bandwidth, peer_overlap)
    F, M = in_flight_, num_microbatches
    if PEER not in allowed:
        peer_capacity = 0.0
    floor = min_activation_memory(ops, input_bytes, F, stage_input_bytes, allowed, peer_capacity)
    if floor > budget:
        short = int(math.ceil(floor - budget))
        peer = f" and {peer_capacity:.0f} bytes held by the paired stage" if PEER in allowed else ""
        raise ActivationError(
            f"budget: the activations of {len(ops)} ops holding {F} micro-batches need at least {floor} bytes "
            f"({floor / _MIB:.2f} MiB) with every op at its smallest choice among {list(allowed)}{peer}, against "
            f"{budget:.0f} bytes ({budget / _MIB:.2f} MiB): short by {short} bytes ({short / _MIB:.2f} MiB). "
            f"Hint: raise the budget to at least {floor} bytes (in a run: memory.activation_budget_bytes), use "
            "more stages, or hold fewer micro-batches in flight (1F1B)", short_by=short)
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ActivationError(f"resolution: expected a positive int (bytes), found {resolution!r}")
    cost = _Cost(M / host_bandwidth, overlap, M / peer_bandwidth, peer_overlap)
    order = {c: i for i, c in enumerate(ALL_CHOICES)}

    def totals(ch: Sequence[str]) -> tuple[float, int, int]:
        rec = sum(M * op.fwd for op, c in zip(ops, ch) if c == "recompute")
        swap = sum(op.act_bytes for op, c in zip(ops, ch) if c == "swap")
        peer = sum(op.act_bytes for op, c in zip(ops, ch) if c == PEER)
        return rec, swap, peer

    # an upper bound on the optimum (a greedy plan) prunes the search. With the peer tier also
    # the greedy plan without it: peering first can leave the rest unable to fit (a peered op
    # saves less than a recomputed one), and at a coarse resolution the search may then find only
    # plans worse than one without the tier
    greedy = _greedy(ops, input_bytes, F, M, budget, stage_input_bytes, allowed, cost, peer_capacity)
    if PEER in allowed:
        alone = _greedy(ops, input_bytes, F, M, budget, stage_input_bytes, [c for c in allowed if c != PEER], cost,
                        0.0)
        if alone is not None and (greedy is None or cost.added(*totals(alone)) < cost.added(*totals(greedy))):
            greedy = alone
    best = None
    bound = math.inf
    if greedy is not None:
        g = cost.added(*totals(greedy))
        bound = g * (1 + 1e-9) + 1e-15
        best = ((g, [order[c] for c in greedy]), greedy)
    # the best plan so far bounds the later caps' searches too, loosened by what rounding to the
    # resolution can add to a plan's bytes (so no plan as good as it is dropped: the same result)
    slack = len(ops) * (resolution - 1) * (cost.per_byte + cost.peer_per_byte)
    for cap in reversed(_caps(ops, allowed)):  # the most recompute first: usually the cheapest
        found = _pareto(ops, input_bytes, F, M, budget, F * stage_input_bytes + cap,
                        [_allowed_under(cap, op, allowed, F, peer_capacity) for op in ops], order, resolution,
                        cost, bound, peer_capacity)
        for ch in found:
            key = (cost.added(*totals(ch)), [order[c] for c in ch])
            if best is None or key < best[0]:
                best = (key, ch)
        if best is not None:
            bound = min(bound, best[0][0] * (1 + 1e-9) + 1e-15 + slack)
    if best is None:
        if resolution == 1:  # the floor says a plan fits: the exact search cannot miss it
            raise ActivationError(f"budget: no plan found within {budget:.0f} bytes although the least memory is "
                                  f"{floor} bytes (a bug in the search)")
        # rounding up at this resolution lost the last feasible plans: search exactly
        return plan_activations(ops, input_bytes, F, M, budget, host_bandwidth, overlap, stage_input_bytes, allowed,
                                peer_capacity=peer_capacity, peer_bandwidth=peer_bandwidth, peer_overlap=peer_overlap)
    ch = best[1]
    rec, swap, peer = totals(ch)
    exposed, exposed_peer = cost.exposed(swap, peer)
    mem = activation_memory(ops, input_bytes, ch, F, stage_input_bytes)
    held = sum(peer_held(op.act_bytes, F) for op, c in zip(ops, ch) if c == PEER)
    return ActivationPlan(tuple(op.op_id for op in ops), tuple(ch), mem, float(budget), rec, M * swap, exposed,
                          rec + exposed + exposed_peer, M * peer, held, exposed_peer)


def _greedy(ops: Sequence[OpCost], input_bytes: Sequence[int], F: int, M: int, budget: float, stage_input_bytes: int,
            allowed: Sequence[str], cost: _Cost, peer_capacity: float) -> tuple[str, ...] | None:
    """A plan that fits, made by changing kept ops one at a time, each time the change that saves
    the most bytes per added second, until the budget is met (None when this stops short)."""
    ch = ["keep"] * len(ops)
    mem = activation_memory(ops, input_bytes, ch, F, stage_input_bytes)
    transient = 0
    rec, swap, peer, held = 0.0, 0, 0, 0
    while mem > budget:
        best = None
        for k, (op, x) in enumerate(zip(ops, input_bytes)):
            if ch[k] != "keep":
                continue
            for c in allowed:
                if c == "keep" or (c == PEER and held + peer_held(op.act_bytes, F) > peer_capacity):
                    continue
                new_t = max(transient, op.act_bytes) if c == "recompute" else transient
                saved = (F * op.act_bytes - op_memory(c, op.act_bytes, x, F)) - (new_t - transient)
                if saved <= 0:
                    continue
                r = rec + (M * op.fwd if c == "recompute" else 0.0)
                a = swap + (op.act_bytes if c == "swap" else 0)
                p = peer + (op.act_bytes if c == PEER else 0)
                extra = cost.added(r, a, p) - cost.added(rec, swap, peer)
                score = saved / (extra + 1e-12)
                if best is None or score > best[0]:
                    best = (score, k, c, saved, new_t, r, a, p)
        if best is None:
            return None
        _, k, c, saved, transient, rec, swap, peer = best
        held += peer_held(ops[k].act_bytes, F) if c == PEER else 0
        ch[k] = c
        mem -= saved
    return tuple(ch)


def _pareto(ops: Sequence[OpCost], input_bytes: Sequence[int], F: int, M: int, budget: float, base: int,
            allowed: list[tuple[str, ...]], order: Mapping[str, int], resolution: int, cost: _Cost,
            bound: float, peer_capacity: float) -> list[tuple[str, ...]]:
    """The choices of every plan not beaten on all of recompute time, memory, swapped and peered bytes.

    States are ``(recompute seconds, memory, swapped bytes, peered bytes per micro-batch, choices)``,
    bytes in units of ``resolution`` rounded up, choices as their places in ``order``; ``rest[k]``
    is the least memory ops k.. can still take, to drop states that cannot fit; states already
    dearer than ``bound``, or whose pair would hold more than ``peer_capacity``, go too."""
    def units(b: int) -> int:
        return -(-b // resolution)

    names = sorted(order, key=order.__getitem__)
    # per op, each allowed choice as (code, memory, recompute seconds, swapped units, peered units)
    options = []
    for k, (op, x) in enumerate(zip(ops, input_bytes)):
        a = units(op.act_bytes)
        options.append([(order[c], units(op_memory(c, op.act_bytes, x, F)), M * op.fwd if c == "recompute" else 0.0,
                         a if c == "swap" else 0, a if c == PEER else 0) for c in allowed[k]])
    cap_units = math.floor(budget / resolution)
    # the most peered units the pair can hold (each rounded up, as held)
    peer_units = math.floor(peer_capacity / (max(F - 1, 0) * resolution)) if F > 1 else math.inf
    sw, ov = resolution * cost.per_byte, cost.overlap
    pw, pov = resolution * cost.peer_per_byte, cost.peer_overlap
    rest = [0] * (len(ops) + 1)
    for k in reversed(range(len(ops))):
        rest[k] = rest[k + 1] + min(o[1] for o in options[k])
    if units(base) + rest[0] > cap_units:
        return []
    states: list[tuple[float, int, int, int, tuple[int, ...]]] = [(0.0, units(base), 0, 0, ())]
    for k in range(len(ops)):
        grown = []
        room = cap_units - rest[k + 1]
        for rec, mem, swap, peer, ch in states:
            for code, dm, dr, da, dp in options[k]:
                m = mem + dm
                if m > room:
                    continue
                p = peer + dp
                if dp and p > peer_units:
                    continue
                r, a = rec + dr, swap + da
                es, ep = a * sw - ov, p * pw - pov
                if r + (es if es > 0 else 0.0) + (ep if ep > 0 else 0.0) > bound:
                    continue
                grown.append((r, m, a, p, ch + (code,)))
        # keep the states no other beats on all four; among equals the earliest in choice order
        # (keep, swap, recompute, peer), so ties go to keeping. Every accepted state has no more
        # recompute time (the sort); per amount of one link's units (the key) a staircase of the
        # accepted (memory, the other link's units): a state is beaten when a staircase of no
        # larger key covers it. The key is the link with fewer distinct amounts: peered units
        # (all 0) without a pair, swapped units with one (a peer is the cheaper of the two)
        grown.sort()
        kd, sd = (2, 3) if peer_units > 0 else (3, 2)
        keys: list[int] = []  # key amounts with a staircase, ascending
        fronts: dict[int, tuple[list[int], list[int]]] = {}
        states = []
        for st in grown:
            m, key, other = st[1], st[kd], st[sd]
            beaten = False
            for q in keys:
                if q > key:
                    break
                if _covered(fronts[q], m, other):
                    beaten = True
                    break
            if beaten:
                continue
            states.append(st)
            if key not in fronts:
                bisect.insort(keys, key)
                fronts[key] = ([], [])
            _stair_add(fronts[key], m, other)
    return [tuple(names[c] for c in st[4]) for st in states]


def _covered(stair: tuple[list[int], list[int]], m: int, a: int) -> bool:
    """Whether the staircase (memory ascending, units strictly descending) has an entry with no
    more memory and no more units than ``(m, a)``."""
    mem, units = stair
    i = bisect.bisect_right(mem, m)
    return bool(i) and units[i - 1] <= a


def _stair_add(stair: tuple[list[int], list[int]], m: int, a: int) -> None:
    """Put ``(m, a)`` on the staircase unless an entry covers it, dropping the entries it covers."""
    if _covered(stair, m, a):
        return
    mem, units = stair
    i = bisect.bisect_right(mem, m)
    j = i
    while j < len(mem) and units[j] >= a:
        j += 1
    mem[i:j] = [m]
    units[i:j] = [a]


def stage_activation_plan(problem: PartitionProblem, bounds: Sequence[int], stage: int, budget: float,
                          host_bandwidth: float = math.inf, overlap: float = 0.0,
                          allowed: Sequence[str] = CHOICES, *, peer_capacity: float = 0.0,
                          peer_bandwidth: float = math.inf, peer_overlap: float = 0.0) -> ActivationPlan:
    """:func:`plan_activations` for stage ``stage`` of a partition: its ops ``bounds[s]:bounds[s+1]``,
    op ``k``'s input taken as ``cut_bytes[k]`` (what is live across the boundary before it: the
    input of a chain's op), the stage input ``cut_bytes[bounds[s]]`` and ``in_flight`` from the
    problem's schedule."""
    ops, inputs, F, stage_input = _stage(problem, bounds, stage)
    return plan_activations(ops, inputs, F, problem.num_microbatches, budget, host_bandwidth, overlap, stage_input,
                            allowed, peer_capacity=peer_capacity, peer_bandwidth=peer_bandwidth,
                            peer_overlap=peer_overlap)


def stage_activation_floor(problem: PartitionProblem, bounds: Sequence[int], stage: int,
                           allowed: Sequence[str] = CHOICES) -> int:
    """The least activation memory any plan of stage ``stage`` reaches (:func:`min_activation_memory`
    of the ops :func:`stage_activation_plan` plans): that plan raises exactly when its budget is below it."""
    ops, inputs, F, stage_input = _stage(problem, bounds, stage)
    return min_activation_memory(ops, inputs, F, stage_input, allowed)


def _stage(problem: PartitionProblem, bounds: Sequence[int],
           stage: int) -> tuple[tuple[OpCost, ...], list[int], int, int]:
    """Stage ``stage``'s ops, each op's input bytes (0 for the first: the stage input), the
    micro-batches it holds and its input bytes."""
    i, j = bounds[stage], bounds[stage + 1]
    ops = problem.ops[i:j]
    inputs = [0] + [problem.cut_bytes[k] for k in range(i + 1, j)]
    return ops, inputs[:len(ops)], problem.in_flight[stage], problem.cut_bytes[i]


def partition_activation_plans(problem: PartitionProblem, part: Partition, host_bandwidth: float = math.inf,
                               overlap: Sequence[float] | float = 0.0) -> tuple[ActivationPlan, ...]:
    """Every stage's activation plan for a split made under a :class:`~pipeline.plan.partition.
    ManagedMemory` model: each stage's budget less its resident op state and reserve is what its
    activations may take. ``overlap``: idle host-link seconds per step, per stage or one for all."""
    mm = problem.memory
    if mm is None or problem.memory_budget is None:
        raise PartitionError("partition_activation_plans: expected a problem with memory (a ManagedMemory) and "
                             f"memory_budget, found memory={mm!r}, memory_budget={problem.memory_budget!r}")
    P = problem.num_stages
    overlaps = (float(overlap),) * P if isinstance(overlap, (int, float)) else tuple(overlap)
    reserve = mm.reserves(P)
    b = part.bounds
    plans = []
    for s in range(P):
        state = sum(mm.state_bytes(op) for op in problem.ops[b[s]:b[s + 1]])
        allowed = CHOICES if mm.activations == "auto" else ("keep",)
        plans.append(stage_activation_plan(problem, b, s, problem.memory_budget[s] - state - reserve[s],
                                           host_bandwidth, overlaps[s], allowed))
    return tuple(plans)
