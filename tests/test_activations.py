"""Activation plans: the exact planner against enumeration (the peer tier included), the memory model,
the pairing of stages, the shortfall error."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.plan.activations import (
    ALL_CHOICES, CHOICES, PEER, ActivationError, activation_memory, min_activation_memory, peer_held, plan_activations,
    stage_activation_plan,
)
from pipeline.plan.pairs import gives, pair_of, stage_activation_plans
from pipeline.plan.partition import OpCost, PartitionProblem
from pipeline.plan.schedule import in_flight


def random_ops(rng: np.random.Generator, n: int) -> tuple[list[OpCost], list[int]]:
    ops = [OpCost(f"op{k}", float(rng.integers(1, 9)) * 1e-3, 2e-3, 0, 0, int(rng.integers(1, 12)) * 1000)
           for k in range(n)]
    inputs = [0] + [int(rng.integers(0, 4)) * 1000 for _ in range(n - 1)]
    return ops, inputs


def fits_pair(ops, choices, F, capacity) -> bool:
    return sum(peer_held(op.act_bytes, F) for op, c in zip(ops, choices) if c == PEER) <= capacity


def brute_force(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed=CHOICES, capacity=0.0, peer_bw=math.inf,
                peer_overlap=0.0):
    best = math.inf
    for choices in itertools.product(allowed, repeat=len(ops)):
        if activation_memory(ops, inputs, choices, F, stage_in) > budget or not fits_pair(ops, choices, F, capacity):
            continue
        rec = sum(M * op.fwd for op, c in zip(ops, choices) if c == "recompute")
        swap = sum(op.act_bytes for op, c in zip(ops, choices) if c == "swap")
        peer = sum(op.act_bytes for op, c in zip(ops, choices) if c == PEER)
        best = min(best, rec + max(0.0, M * swap / bw - overlap) + max(0.0, M * peer / peer_bw - peer_overlap))
    return best


def least_memory(ops, inputs, F, stage_in, allowed, capacity) -> int:
    return min(activation_memory(ops, inputs, ch, F, stage_in) for ch in itertools.product(allowed, repeat=len(ops))
               if fits_pair(ops, ch, F, capacity))


@pytest.mark.parametrize("seed", range(120))
def test_plan_matches_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    ops, inputs = random_ops(rng, n)
    F, M = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    stage_in = int(rng.integers(0, 3)) * 1000
    allowed = CHOICES if seed % 4 else ("keep", "recompute")
    keep_all = activation_memory(ops, inputs, ["keep"] * n, F, stage_in)
    floor = min_activation_memory(ops, inputs, F, stage_in, allowed)
    budget = float(rng.integers(floor, keep_all + 1)) if keep_all > floor else float(floor)
    bw = float(rng.choice([1e5, 1e6, 1e7]))
    overlap = float(rng.choice([0.0, 0.01, 0.1]))
    plan = plan_activations(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed)
    assert plan.memory == activation_memory(ops, inputs, plan.choices, F, stage_in) <= budget
    assert set(plan.choices) <= set(allowed)
    assert plan.added_s == pytest.approx(brute_force(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed),
                                         rel=1e-12, abs=1e-15)
    assert plan.added_s == pytest.approx(plan.recompute_s + plan.exposed_swap_s)
    assert plan.swap_bytes == M * sum(op.act_bytes for op, c in zip(ops, plan.choices) if c == "swap")


PEER_ALLOWED = (ALL_CHOICES, ("keep", "recompute", PEER), ("keep", PEER), ("keep", "swap", PEER))


@pytest.mark.parametrize("seed", range(160))
def test_peer_plan_matches_enumeration(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 7))
    ops, inputs = random_ops(rng, n)
    F, M = int(rng.integers(1, 7)), int(rng.integers(1, 9))
    stage_in = int(rng.integers(0, 3)) * 1000
    allowed = PEER_ALLOWED[seed % len(PEER_ALLOWED)]
    capacity = float(rng.integers(0, 6)) * 5000 * max(F - 1, 1) * float(rng.choice([0.5, 1.0]))
    keep_all = activation_memory(ops, inputs, ["keep"] * n, F, stage_in)
    floor = min_activation_memory(ops, inputs, F, stage_in, allowed, capacity)
    assert floor == least_memory(ops, inputs, F, stage_in, allowed, capacity)  # exact with the pair's bound
    budget = float(rng.integers(floor, keep_all + 1)) if keep_all > floor else float(floor)
    bw, peer_bw = float(rng.choice([1e5, 1e6, 1e7])), float(rng.choice([1e6, 6e6, 1e8]))
    overlap, peer_overlap = float(rng.choice([0.0, 0.01, 0.1])), float(rng.choice([0.0, 0.005, 0.05]))
    plan = plan_activations(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed, peer_capacity=capacity,
                            peer_bandwidth=peer_bw, peer_overlap=peer_overlap)
    assert plan.memory == activation_memory(ops, inputs, plan.choices, F, stage_in) <= budget
    assert set(plan.choices) <= set(allowed)
    assert plan.peer_held == sum(peer_held(op.act_bytes, F) for op, c in zip(ops, plan.choices) if c == PEER)
    assert plan.peer_held <= capacity
    assert plan.peer_bytes == M * sum(op.act_bytes for op, c in zip(ops, plan.choices) if c == PEER)
    assert plan.added_s == pytest.approx(brute_force(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed,
                                                     capacity, peer_bw, peer_overlap), rel=1e-12, abs=1e-15)
    assert plan.added_s == pytest.approx(plan.recompute_s + plan.exposed_swap_s + plan.exposed_peer_s)
    # the peer tier never makes a plan worse: without it (same budget, if it fits) it costs no less
    alone = tuple(c for c in allowed if c != PEER)
    if min_activation_memory(ops, inputs, F, stage_in, alone) <= budget:
        without = plan_activations(ops, inputs, F, M, budget, bw, overlap, stage_in, alone)
        assert plan.added_s <= without.added_s + 1e-15
    # a coarse grain still fits the budget and the pair's bound
    coarse = plan_activations(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed, 4096,
                              peer_capacity=capacity, peer_bandwidth=peer_bw, peer_overlap=peer_overlap)
    assert coarse.memory <= budget and coarse.peer_held <= capacity
    assert coarse.added_s >= plan.added_s - 1e-15


def test_peer_hands_the_busy_stage_activations_to_its_pair() -> None:
    op = OpCost("a", 1e-3, 2e-3, 0, 0, 1000)
    # F = 8: keep 8000 B, peer 2000 B here and 7000 B on the pair; recompute 8 * 100 + 1000 = 1800 B
    plan = plan_activations([op], [100], 8, 8, 2000, host_bandwidth=1e5, allowed=ALL_CHOICES, peer_capacity=7000,
                            peer_bandwidth=1e9)
    assert plan.choices == (PEER,) and plan.peer_held == 7000 and plan.memory == 2000
    assert plan.exposed_peer_s == pytest.approx(8 * 1000 / 1e9)
    # the pair has 1 byte too few: recompute instead
    plan = plan_activations([op], [100], 8, 8, 2000, host_bandwidth=1e5, allowed=ALL_CHOICES, peer_capacity=6999,
                            peer_bandwidth=1e9)
    assert plan.choices == ("recompute",)
    # too little room even for recomputing: the error counts the pair's bytes
    with pytest.raises(ActivationError, match="held by the paired stage"):
        plan_activations([op], [100], 8, 8, 1000, allowed=ALL_CHOICES, peer_capacity=6999)


def test_pairs_plan_holders_first_and_count_what_they_hold() -> None:
    P, M = 4, 8
    ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, 0, 0, 4000) for k in range(8))
    problem = PartitionProblem(ops, tuple([1000] * 9), P, M, "1f1b")
    bounds = (0, 2, 4, 6, 8)
    assert [pair_of(s, P) for s in range(P)] == [3, 2, 1, 0]
    assert [gives(s, P) for s in range(P)] == [True, True, False, False]
    assert [gives(s, 5) for s in range(5)] == [True, True, False, False, False]  # the middle stage keeps to itself
    budgets = [4 * 2 * 4000 + 4 * 1000 - 8000] + [40000] * 3  # stage 0 (F = 4) 8000 B short of keeping all
    alone = stage_activation_plans(problem, bounds, budgets, host_bandwidth=1e5)
    paired = stage_activation_plans(problem, bounds, budgets, host_bandwidth=1e5, allowed=ALL_CHOICES,
                                    peer_bandwidth=1e12)
    assert alone[0].added_s > 0 and PEER not in alone[0].choices
    assert paired[0].choices.count(PEER) >= 1 and paired[0].added_s < alone[0].added_s
    assert paired[3].held_for_pair == paired[0].peer_held == 3 * 4000 * paired[0].choices.count(PEER)
    for s in range(P):
        assert paired[s].device_bytes <= budgets[s]
        if not gives(s, P):
            assert PEER not in paired[s].choices and paired[s].choices == alone[s].choices
    assert paired[1].held_for_pair == 0 and paired[2].held_for_pair == paired[1].peer_held


def test_enough_memory_keeps_everything() -> None:
    ops, inputs = random_ops(np.random.default_rng(0), 5)
    keep_all = activation_memory(ops, inputs, ["keep"] * 5, 4)
    plan = plan_activations(ops, inputs, 4, 8, keep_all, 1e9)
    assert plan.choices == ("keep",) * 5 and plan.added_s == 0.0


def test_swap_hides_behind_compute_and_recompute_when_it_cannot() -> None:
    op = OpCost("a", 1e-3, 2e-3, 0, 0, 1000)
    # F = 4: keep 4000 B, swap 2000 B, recompute 4 * 100 + 1000 = 1400 B
    plan = plan_activations([op], [100], 4, 8, 2000, host_bandwidth=1e6, overlap=1.0)
    assert plan.choices == ("swap",) and plan.added_s == 0.0
    plan = plan_activations([op], [100], 4, 8, 2000, host_bandwidth=1e6, overlap=0.0)
    assert plan.choices == ("swap",) and plan.added_s == pytest.approx(8e-3)  # a tie with recompute: swap first
    plan = plan_activations([op], [100], 4, 8, 2000, host_bandwidth=1e5, overlap=0.0)
    assert plan.choices == ("recompute",)


def test_early_stages_need_more_help_under_1f1b() -> None:
    P, M = 4, 8
    ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, 0, 0, 4000) for k in range(8))
    problem = PartitionProblem(ops, tuple([1000] * 9), P, M, "1f1b")
    bounds = (0, 2, 4, 6, 8)
    plans = [stage_activation_plan(problem, bounds, s, budget=3 * 2 * 4000 + 3000, host_bandwidth=1e6)
             for s in range(P)]
    assert [p.added_s > 0 for p in plans] == [True, False, False, False]
    assert in_flight("1f1b", P, M) == (4, 3, 2, 1)


def test_infeasible_budget_names_the_shortfall() -> None:
    op = OpCost("a", 1e-3, 2e-3, 0, 0, 1 << 20)
    # F = 1: nothing helps; 1 MiB of activations against half a MiB
    with pytest.raises(ActivationError, match=r"short by 524288 bytes \(0.50 MiB\)") as e:
        plan_activations([op], [0], 1, 4, 1 << 19)
    assert e.value.short_by == 1 << 19
    with pytest.raises(ActivationError, match="input_bytes: expected 1 values"):
        plan_activations([op], [], 1, 4, 1 << 22)
    with pytest.raises(ActivationError, match="allowed: expected"):
        plan_activations([op], [0], 1, 4, 1 << 22, allowed=("swap",))


@pytest.mark.parametrize("seed", range(30))
def test_coarse_resolution_still_fits(seed: int) -> None:
    rng = np.random.default_rng(500 + seed)
    ops, inputs = random_ops(rng, int(rng.integers(2, 7)))
    inputs = [x + int(rng.integers(0, 999)) for x in inputs]  # not multiples of the grain
    F, M = int(rng.integers(3, 6)), 4
    keep_all = activation_memory(ops, inputs, ["keep"] * len(ops), F)
    budget = float(keep_all) * 0.6
    try:
        exact = plan_activations(ops, inputs, F, M, budget, 1e6, 0.0)
    except ActivationError:
        return
    coarse = plan_activations(ops, inputs, F, M, budget, 1e6, 0.0, resolution=4096)
    assert coarse.memory == activation_memory(ops, inputs, coarse.choices, F) <= budget
    assert coarse.added_s >= exact.added_s - 1e-15


@pytest.mark.parametrize("seed", range(200))
def test_the_peer_tier_never_plans_worse_than_none_at_a_coarse_resolution(seed: int) -> None:
    """Allowing ``peer`` only adds choices, so its plan costs no more than the plan without it. A
    greedy bound that peers first can leave the rest unable to fit; at a coarse resolution the
    search then found only dearer plans (NASPipe's space at 8x: 11.1 ms for 2.9 ms)."""
    rng = np.random.default_rng(900 + seed)
    ops, inputs = random_ops(rng, int(rng.integers(3, 8)))
    inputs = [x + int(rng.integers(0, 999)) for x in inputs]
    F, M = int(rng.integers(3, 9)), 4
    keep_all = activation_memory(ops, inputs, ["keep"] * len(ops), F)
    budget = float(keep_all) * float(rng.uniform(0.15, 0.6))
    grain = int(rng.choice([1024, 2048, 4096]))
    capacity = float(rng.integers(0, 4)) * F * 1000
    try:
        alone = plan_activations(ops, inputs, F, M, budget, 1e6, 0.0, resolution=grain)
    except ActivationError:
        return
    both = plan_activations(ops, inputs, F, M, budget, 1e6, 0.0, allowed=ALL_CHOICES, resolution=grain,
                            peer_capacity=capacity, peer_bandwidth=1e7, peer_overlap=0.0)
    assert both.memory <= budget
    assert both.added_s <= alone.added_s * (1 + 1e-9) + 1e-15
