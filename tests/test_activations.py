"""Activation plans: the exact planner against enumeration, the memory model, the shortfall error."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.plan.activations import (
    CHOICES, ActivationError, activation_memory, min_activation_memory, plan_activations, stage_activation_plan,
)
from pipeline.plan.partition import OpCost, PartitionProblem
from pipeline.plan.schedule import in_flight


def random_ops(rng: np.random.Generator, n: int) -> tuple[list[OpCost], list[int]]:
    ops = [OpCost(f"op{k}", float(rng.integers(1, 9)) * 1e-3, 2e-3, 0, 0, int(rng.integers(1, 12)) * 1000)
           for k in range(n)]
    inputs = [0] + [int(rng.integers(0, 4)) * 1000 for _ in range(n - 1)]
    return ops, inputs


def brute_force(ops, inputs, F, M, budget, bw, overlap, stage_in, allowed=CHOICES):
    best = math.inf
    for choices in itertools.product(allowed, repeat=len(ops)):
        if activation_memory(ops, inputs, choices, F, stage_in) > budget:
            continue
        rec = sum(M * op.fwd for op, c in zip(ops, choices) if c == "recompute")
        swap = sum(op.act_bytes for op, c in zip(ops, choices) if c == "swap")
        best = min(best, rec + max(0.0, M * swap / bw - overlap))
    return best


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
