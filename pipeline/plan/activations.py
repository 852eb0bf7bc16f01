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
======================  ==========================  ============================================

plus ``F * stage_input_bytes`` (the received input, always kept) plus, when any op is recomputed,
the largest recomputed ``a`` (the one micro-batch's activations re-made during its backward;
recomputed ops run their backwards one at a time). The model is conservative where a recomputed
input is also the previous op's kept output (counted twice). :func:`plan_activations` finds the
plan of least added time within the budget exactly: for each cap on the recomputed ``a`` it runs
a dynamic programme over the ops keeping the Pareto front of memory, swapped bytes and recompute
time, pruned by the cost of a greedy plan (tests check it against enumeration; ``resolution``
trades exactness for speed). A budget below :func:`min_activation_memory` raises
:class:`ActivationError` with the shortfall.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .partition import OpCost, Partition, PartitionError, PartitionProblem

__all__ = ["CHOICES", "ActivationError", "ActivationPlan", "plan_activations", "activation_memory",
           "min_activation_memory", "stage_activation_plan", "stage_activation_floor", "op_memory",
           "partition_activation_plans"]

CHOICES = ("keep", "swap", "recompute")
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
    added_s: float         # recompute_s + exposed_swap_s

    def choice(self) -> dict[str, str]:
        """``op_id -> "keep" | "swap" | "recompute"``."""
        return dict(zip(self.op_ids, self.choices))


def op_memory(choice: str, act_bytes: int, input_bytes: int, in_flight_: int) -> int:
    """Device bytes one op's activations take under ``choice``, without the recompute transient
    (the table in the module doc)."""
    if choice == "keep":
        return in_flight_ * act_bytes
    if choice == "swap":
        return min(in_flight_, 2) * act_bytes
    if choice == "recompute":
        return in_flight_ * input_bytes
    raise ActivationError(f"choice: expected one of {list(CHOICES)}, found {choice!r}")


def activation_memory(ops: Sequence[OpCost], input_bytes: Sequence[int], choices: Sequence[str], in_flight_: int,
                      stage_input_bytes: int = 0) -> int:
    """The device bytes of a stage's activations under the given choices."""
    transient = max((op.act_bytes for op, c in zip(ops, choices) if c == "recompute"), default=0)
    return in_flight_ * stage_input_bytes + transient + sum(
        op_memory(c, op.act_bytes, x, in_flight_) for op, x, c in zip(ops, input_bytes, choices))


def _caps(ops: Sequence[OpCost], allowed: Sequence[str]) -> list[int]:
    """The candidate caps on the recomputed ops' largest ``act_bytes`` (0: nothing recomputed)."""
    return [0] + (sorted({op.act_bytes for op in ops}) if "recompute" in allowed else [])


def _allowed_under(cap: int, op: OpCost, allowed: Sequence[str]) -> tuple[str, ...]:
    return tuple(c for c in allowed if c != "recompute" or (cap > 0 and op.act_bytes <= cap))


def min_activation_memory(ops: Sequence[OpCost], input_bytes: Sequence[int], in_flight_: int,
                          stage_input_bytes: int = 0, allowed: Sequence[str] = CHOICES) -> int:
    """The least activation memory any plan reaches."""
    return min(in_flight_ * stage_input_bytes + cap + sum(
        min(op_memory(c, op.act_bytes, x, in_flight_) for c in _allowed_under(cap, op, allowed))
        for op, x in zip(ops, input_bytes)) for cap in _caps(ops, allowed))


def _check(ops: Sequence[OpCost], input_bytes: Sequence[int], in_flight_: int, num_microbatches: int,
           host_bandwidth: float, overlap: float, allowed: Sequence[str]) -> None:
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
    if not (host_bandwidth > 0):
        raise ActivationError(f"host_bandwidth: expected a positive number of bytes/s, found {host_bandwidth!r}")
    if not (math.isfinite(overlap) and overlap >= 0):
        raise ActivationError(f"overlap: expected a finite non-negative number of seconds, found {overlap!r}")
    bad = [c for c in allowed if c not in CHOICES]
    if bad or "keep" not in allowed:
        raise ActivationError(f"allowed: expected choices among {list(CHOICES)} including 'keep', "
                              f"found {list(allowed)}")


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
) -> ActivationPlan:
    """The keep/swap/recompute choice per op whose activations fit ``budget`` at the least added time.

    ``ops``: the stage's active ops in order; ``input_bytes[k]``: op ``k``'s input bytes per
    micro-batch (0 for an op whose input is the stage input, kept anyway); ``in_flight_``: micro-
    batches the schedule holds on this stage; ``overlap``: seconds per step the host link is idle
    while the stage computes (swaps up to that hide). Ties go to keeping, then to swapping.
    ``resolution`` (bytes): 1 is exact; a coarser grain (e.g. 1 MiB) rounds each op's memory and
    swapped bytes up to it inside the search, which bounds the number of states on stages of many
    ops (the plan still fits: its reported memory is exact and at most the rounded one).
    """
    _check(ops, input_bytes, in_flight_, num_microbatches, host_bandwidth, overlap, allowed)
    F, M = in_flight_, num_microbatches
    floor = min_activation_memory(ops, input_bytes, F, stage_input_bytes, allowed)
    if floor > budget:
        short = int(math.ceil(floor - budget))
        raise ActivationError(
            f"budget: the activations of {len(ops)} ops holding {F} micro-batches need at least {floor} bytes "
            f"({floor / _MIB:.2f} MiB) with every op at its smallest choice among {list(allowed)}, against "
            f"{budget:.0f} bytes ({budget / _MIB:.2f} MiB): short by {short} bytes ({short / _MIB:.2f} MiB). "
            f"Hint: raise the budget to at least {floor} bytes (in a run: memory.activation_budget_bytes), use "
            "more stages, or hold fewer micro-batches in flight (1F1B)", short_by=short)
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ActivationError(f"resolution: expected a positive int (bytes), found {resolution!r}")
    per_byte = M / host_bandwidth  # link seconds per swapped byte (each direction)
    order = {c: i for i, c in enumerate(CHOICES)}

    def cost(ch: Sequence[str]) -> tuple[float, int, float]:
        rec = sum(M * op.fwd for op, c in zip(ops, ch) if c == "recompute")
        swap = sum(op.act_bytes for op, c in zip(ops, ch) if c == "swap")
        return rec, swap, max(0.0, swap * per_byte - overlap)

    cost.M, cost.per_byte, cost.overlap = M, per_byte, overlap

    # an upper bound on the optimum (a greedy plan) prunes the search
    greedy = _greedy(ops, input_bytes, F, budget, stage_input_bytes, allowed, cost)
    bound = math.inf if greedy is None else sum(cost(greedy)[::2]) * (1 + 1e-9) + 1e-15
    best = None
    if greedy is not None:
        rec, swap, exposed = cost(greedy)
        best = ((rec + exposed, [order[c] for c in greedy]), greedy)
    for cap in _caps(ops, allowed):
        found = _pareto(ops, input_bytes, F, M, budget, F * stage_input_bytes + cap,
                        [_allowed_under(cap, op, allowed) for op in ops], order, resolution,
                        per_byte, overlap, bound)
        for ch in found:
            rec, swap, exposed = cost(ch)
            key = (rec + exposed, [order[c] for c in ch])
            if best is None or key < best[0]:
                best = (key, ch)
    if best is None:  # rounding up at this resolution lost the last feasible plans: search exactly
        return plan_activations(ops, input_bytes, F, M, budget, host_bandwidth, overlap, stage_input_bytes, allowed)
    ch = best[1]
    rec, swap, exposed = cost(ch)
    mem = activation_memory(ops, input_bytes, ch, F, stage_input_bytes)
    return ActivationPlan(tuple(op.op_id for op in ops), tuple(ch), mem, float(budget), rec, M * swap, exposed,
                          rec + exposed)


def _greedy(ops: Sequence[OpCost], input_bytes: Sequence[int], F: int, budget: float, stage_input_bytes: int,
            allowed: Sequence[str], cost) -> tuple[str, ...] | None:
    """A plan that fits, made by changing kept ops one at a time, each time the change that saves
    the most bytes per added second, until the budget is met (None when this stops short)."""
    ch = ["keep"] * len(ops)
    mem = activation_memory(ops, input_bytes, ch, F, stage_input_bytes)
    transient = 0
    rec, swap, _ = cost(ch)
    per_byte, overlap = cost.per_byte, cost.overlap
    while mem > budget:
        best = None
        for k, (op, x) in enumerate(zip(ops, input_bytes)):
            if ch[k] != "keep":
                continue
            for c in allowed:
                if c == "keep":
                    continue
                new_t = max(transient, op.act_bytes) if c == "recompute" else transient
                saved = (F * op.act_bytes - op_memory(c, op.act_bytes, x, F)) - (new_t - transient)
                if saved <= 0:
                    continue
                r = rec + (cost.M * op.fwd if c == "recompute" else 0.0)
                a = swap + (op.act_bytes if c == "swap" else 0)
                extra = (r + max(0.0, a * per_byte - overlap)) - (rec + max(0.0, swap * per_byte - overlap))
                score = saved / (extra + 1e-12)
                if best is None or score > best[0]:
                    best = (score, k, c, saved, new_t, r, a)
        if best is None:
            return None
        _, k, c, saved, transient, rec, swap = best
        ch[k] = c
        mem -= saved
    return tuple(ch)


def _pareto(ops: Sequence[OpCost], input_bytes: Sequence[int], F: int, M: int, budget: float, base: int,
            allowed: list[tuple[str, ...]], order: Mapping[str, int], resolution: int, per_byte: float,
            overlap: float, bound: float) -> list[tuple[str, ...]]:
    """The choices of every plan not beaten on all of recompute time, memory and swapped bytes.

    States are ``(recompute seconds, memory, swapped bytes per micro-batch, choices)``, memory and
    swapped bytes in units of ``resolution`` rounded up; ``rest[k]`` is the least memory ops k..
    can still take, to drop states that cannot fit; states already dearer than ``bound`` go too."""
    def units(b: int) -> int:
        return -(-b // resolution)

    mem_of = [{c: units(op_memory(c, op.act_bytes, x, F)) for c in allowed[k]}
              for k, (op, x) in enumerate(zip(ops, input_bytes))]
    cap_units = math.floor(budget / resolution)
    rest = [0] * (len(ops) + 1)
    for k in reversed(range(len(ops))):
        rest[k] = rest[k + 1] + min(mem_of[k].values())
    if units(base) + rest[0] > cap_units:
        return []
    states: list[tuple[float, int, int, tuple[str, ...]]] = [(0.0, units(base), 0, ())]
    for k, op in enumerate(ops):
        grown = []
        swap_units = units(op.act_bytes)
        for rec, mem, swap, ch in states:
            for c in allowed[k]:
                m = mem + mem_of[k][c]
                if m + rest[k + 1] > cap_units:
                    continue
                r = rec + (M * op.fwd if c == "recompute" else 0.0)
                a = swap + (swap_units if c == "swap" else 0)
                if r + max(0.0, a * resolution * per_byte - overlap) > bound:
                    continue
                grown.append((r, m, a, ch + (c,)))
        # keep the states no other beats on all three; among equals the earliest in
        # (keep, swap, recompute) order, so ties go to keeping
        grown.sort(key=lambda s: (s[0], s[1], s[2], [order[c] for c in s[3]]))
        front_mem: list[int] = []   # staircase of accepted (memory, swap): memory ascending,
        front_swap: list[int] = []  # swap strictly descending
        states = []
        for st in grown:
            _, m, a, _ = st
            i = bisect.bisect_right(front_mem, m)
            if i and front_swap[i - 1] <= a:
                continue  # an accepted state (no more recompute time) has no more memory nor swap
            states.append(st)
            j = i
            while j < len(front_mem) and front_swap[j] >= a:
                j += 1
            front_mem[i:j] = [m]
            front_swap[i:j] = [a]
    return [st[3] for st in states]


def stage_activation_plan(problem: PartitionProblem, bounds: Sequence[int], stage: int, budget: float,
                          host_bandwidth: float = math.inf, overlap: float = 0.0,
                          allowed: Sequence[str] = CHOICES) -> ActivationPlan:
    """:func:`plan_activations` for stage ``stage`` of a partition: its ops ``bounds[s]:bounds[s+1]``,
    op ``k``'s input taken as ``cut_bytes[k]`` (what is live across the boundary before it: the
    input of a chain's op), the stage input ``cut_bytes[bounds[s]]`` and ``in_flight`` from the
    problem's schedule."""
    ops, inputs, F, stage_input = _stage(problem, bounds, stage)
    return plan_activations(ops, inputs, F, problem.num_microbatches, budget, host_bandwidth, overlap, stage_input,
                            allowed)


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
