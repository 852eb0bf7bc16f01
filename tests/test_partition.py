"""The partitioner: exact against brute force, migration-aware choice, budgets, bad input."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.plan.partition import (
    REL_SLACK, OpCost, Partition, PartitionError, PartitionProblem, evaluate, random_problem, solve, stage_cost,
)
from pipeline.plan.planners import equal_count
from pipeline.plan.schedule import in_flight


def all_bounds(N: int, P: int):
    for inner in itertools.combinations_with_replacement(range(N + 1), P - 1):
        yield (0, *inner, N)


def small_problem(rng: np.random.Generator, N: int, P: int, integral: bool) -> PartitionProblem:
    """Random costs; integral times make many ties, to pin down the tie-breaking."""
    def t() -> float:
        return float(rng.integers(0, 4)) if integral else float(rng.uniform(0, 1))
    ops = tuple(OpCost(f"op{k}", t(), t(), int(rng.integers(0, 50)), int(rng.integers(0, 50)),
                       int(rng.integers(0, 20))) for k in range(N))
    cuts = tuple(int(c) for c in rng.integers(0, 30, size=N + 1))
    schedule = str(rng.choice(["1f1b", "gpipe"]))
    bandwidth = float(rng.choice([math.inf, 10.0, 100.0]))
    latency = float(rng.choice([0.0, 0.5])) if integral else float(rng.uniform(0, 0.2))
    problem = PartitionProblem(ops, cuts, P, int(rng.integers(1, 6)), schedule, bandwidth, latency)
    kind = rng.integers(0, 4)
    if kind == 0:
        return problem  # unlimited
    # budgets around what some random split needs: some loose, some exact (tight), some infeasible
    some = evaluate(problem, sorted_bounds(rng, N, P))
    scale = {1: 1.0, 2: rng.uniform(0.8, 1.2), 3: rng.uniform(0.4, 0.9)}[int(kind)]
    budget = tuple(float(m) * scale if rng.random() < 0.8 else math.inf for m in some.stage_memory)
    return PartitionProblem(ops, cuts, P, problem.num_microbatches, schedule, bandwidth, latency, budget)


def sorted_bounds(rng: np.random.Generator, N: int, P: int) -> tuple[int, ...]:
    return (0, *sorted(int(x) for x in rng.integers(0, N + 1, size=P - 1)), N)


def random_previous(rng: np.random.Generator, problem: PartitionProblem) -> dict[str, int]:
    # arbitrary owners (not contiguous), some ops unowned, some on a stage that no longer exists
    prev = {}
    for op in problem.ops:
        r = rng.random()
        if r < 0.8:
            prev[op.op_id] = int(rng.integers(0, problem.num_stages))
        elif r < 0.9:
            prev[op.op_id] = problem.num_stages
    return prev


def brute_force(problem: PartitionProblem, previous, eps: float):
    """(expected partition, optimum) or (None, smallest shortfall) by enumerating every split."""
    parts = [evaluate(problem, b, previous) for b in all_bounds(problem.num_ops, problem.num_stages)]
    feasible = [p for p in parts if p.fits_memory]
    if not feasible:
        budget = np.asarray(problem.memory_budget)
        return None, min(float((np.asarray(p.stage_memory) - budget).max()) for p in parts)
    optimum = min(p.max_time for p in feasible)
    threshold = (1 + eps) * optimum * (1 + REL_SLACK)
    within = [p for p in feasible if p.max_time <= threshold]
    return min(within, key=lambda p: (p.moved_bytes, p.max_time, p.bounds)), optimum


CASES = [(seed, N, P) for seed in range(6) for N in range(0, 9) for P in range(1, 5)]


@pytest.mark.parametrize("seed,N,P", CASES)
def test_solve_matches_brute_force(seed: int, N: int, P: int) -> None:
    rng = np.random.default_rng([seed, N, P])
    problem = small_problem(rng, N, P, integral=seed % 2 == 0)
    previous = random_previous(rng, problem)
    expected, optimum = brute_force(problem, None, 0.0)
    if expected is None:
        with pytest.raises(PartitionError, match="short by") as info:
            solve(problem)
        assert info.value.short_by == pytest.approx(optimum)
        assert info.value.short_by > 0
        assert f"memory_budget[{info.value.stage}]" in str(info.value)
        return
    got = solve(problem)
    assert got == expected  # eps = 0, no owners: the optimum with the smallest bounds
    assert got.max_time == optimum
    for eps in (0.0, 0.05, 0.2):
        expected, _ = brute_force(problem, previous, eps)
        got = solve(problem, previous, eps)
        assert got == expected
        assert got.max_time <= (1 + eps) * optimum * (1 + REL_SLACK)
        assert got.fits_memory
        if problem.memory_budget is not None:
            assert all(m <= b for m, b in zip(got.stage_memory, problem.memory_budget))


@pytest.mark.parametrize("seed", range(20))
def test_evaluate_is_the_documented_formula(seed: int) -> None:
    rng = np.random.default_rng(seed)
    N, P = int(rng.integers(0, 10)), int(rng.integers(1, 5))
    problem = small_problem(rng, N, P, integral=False)
    previous = random_previous(rng, problem)
    bounds = sorted_bounds(rng, N, P)
    part = evaluate(problem, bounds, previous)
    flight = in_flight(problem.schedule.name, P, problem.num_microbatches)

    def comm(c: int) -> float:
        return 2 * (problem.latency + problem.cut_bytes[c] / problem.bandwidth)

    moved = 0
    for s in range(P):
        i, j = bounds[s], bounds[s + 1]
        ops = problem.ops[i:j]
        time_ = sum(op.fwd + op.bwd for op in ops) + (comm(i) if s > 0 else 0) + (comm(j) if s < P - 1 else 0)
        memory = sum(op.param_bytes + op.optim_bytes for op in ops) + flight[s] * (
            sum(op.act_bytes for op in ops) + problem.cut_bytes[i])
        stage_moved = sum(op.param_bytes + op.optim_bytes for op in ops
                          if op.op_id in previous and previous[op.op_id] != s)
        assert part.stage_times[s] == pytest.approx(time_, rel=1e-12, abs=1e-12)
        assert part.stage_memory[s] == memory
        assert stage_cost(problem, s, i, j, previous) == (part.stage_times[s], memory, stage_moved)
        moved += stage_moved
    assert part.moved_bytes == moved
    assert part.max_time == max(part.stage_times)
    assert part.bounds == bounds


def test_cost_formula_by_hand() -> None:
    ops = (OpCost("a", 1.0, 2.0, 10, 20, 5), OpCost("b", 0.5, 0.5, 1, 2, 3), OpCost("c", 4.0, 4.0, 0, 0, 1))
    problem = PartitionProblem(ops, (7, 100, 200, 9), 3, 4, "1f1b", bandwidth=100.0, latency=0.25)
    part = evaluate(problem, (0, 1, 1, 3), previous={"a": 1, "b": 2, "c": 2})
    # stage 0: op a; sends cut 1 (100 B): 2 * (0.25 + 1)
    # stage 1: empty; relays cut 1 in and out: 2 * 2 * (0.25 + 1); holds min(4, 2) inputs of 100 B
    # stage 2: ops b, c; receives cut 1; in flight min(4, 1) = 1
    assert part.stage_times == (3.0 + 2.5, 5.0, 9.0 + 2.5)
    assert part.stage_memory == (30 + 3 * (5 + 7), 2 * 100, 3 + 1 * (4 + 100))
    assert part.moved_bytes == 30  # a leaves stage 1; b and c stay on stage 2
    assert part.max_time == 11.5


def test_in_flight_rule_per_schedule() -> None:
    ops = (OpCost("a", 1.0, 1.0, 0, 0, 10),)
    gp = PartitionProblem(ops, (0, 0), 2, 6, "gpipe")
    fb = PartitionProblem(ops, (0, 0), 2, 6, "1f1b")
    assert evaluate(gp, (0, 1, 1)).stage_memory == (6 * 10, 0)
    assert evaluate(gp, (0, 0, 1)).stage_memory == (0, 6 * 10)
    assert evaluate(fb, (0, 1, 1)).stage_memory == (2 * 10, 0)  # min(M, P - 0)
    assert evaluate(fb, (0, 0, 1)).stage_memory == (0, 1 * 10)  # min(M, P - 1)


def test_migration_keeps_a_good_enough_split() -> None:
    rng = np.random.default_rng(11)
    base = random_problem(rng, 20, 4)
    current = solve(base)
    owners = current.assignment([op.op_id for op in base.ops])
    # the next subnet costs a little more on one op: the old split is still within 20%
    ops = list(base.ops)
    ops[5] = OpCost(ops[5].op_id, ops[5].fwd * 1.3, ops[5].bwd, ops[5].param_bytes, ops[5].optim_bytes,
                    ops[5].act_bytes)
    nxt = PartitionProblem(tuple(ops), base.cut_bytes, 4, base.num_microbatches, base.schedule,
                           base.bandwidth, base.latency)
    exact = solve(nxt, owners, eps=0.0)
    lazy = solve(nxt, owners, eps=0.2)
    assert lazy.bounds == current.bounds and lazy.moved_bytes == 0
    assert lazy.max_time <= 1.2 * exact.max_time
    assert exact.max_time <= lazy.max_time


def _reference_optimum(problem: PartitionProblem) -> float:
    """A plain scalar DP over (stage, boundary), independent of the vectorised one."""
    N, P = problem.num_ops, problem.num_stages
    budget = problem.memory_budget or (math.inf,) * P
    best = [math.inf] * (N + 1)
    for j in range(N + 1):
        t, m, _ = stage_cost(problem, 0, 0, j)
        best[j] = t if m <= budget[0] else math.inf
    for s in range(1, P):
        new = [math.inf] * (N + 1)
        for j in range(N + 1):
            for i in range(j + 1):
                t, m, _ = stage_cost(problem, s, i, j)
                if m <= budget[s]:
                    new[j] = min(new[j], max(best[i], t))
        best = new
    return best[N]


@pytest.mark.parametrize("seed", range(3))
def test_large_problem_against_scalar_dp(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    loose = random_problem(rng, 24, 5, num_microbatches=6)
    budget = (1.05 * max(equal_count(loose).stage_memory),) * 5
    problem = PartitionProblem(loose.ops, loose.cut_bytes, 5, 6, "1f1b", loose.bandwidth, loose.latency, budget)
    got = solve(problem)
    assert got.max_time == _reference_optimum(problem)
    owners = equal_count(problem).assignment([op.op_id for op in problem.ops])
    moved = [solve(problem, owners, eps).moved_bytes for eps in (0.0, 0.05, 0.2, 1.0)]
    assert moved == sorted(moved, reverse=True)  # a looser tolerance never moves more


def test_infeasible_message() -> None:
    ops = tuple(OpCost(f"op{k}", 1.0, 1.0, 100 << 20, 0, 0) for k in range(4))
    problem = PartitionProblem(ops, (0,) * 5, 2, 2, memory_budget=(150 << 20, 250 << 20))
    with pytest.raises(PartitionError) as info:
        solve(problem)
    msg = str(info.value)
    # best split puts 1 op (100 MiB) on stage 0 and 3 (300 MiB) on stage 1, or 2 + 2: short by 50 MiB
    assert "short by 50.00 MiB" in msg and "memory_budget[" in msg
    assert info.value.short_by == 50 << 20


def test_assignment() -> None:
    part = Partition((0, 2, 2, 3), (0.0,) * 3, (0,) * 3, 0.0, 0)
    assert part.assignment(["a", "b", "c"]) == {"a": 0, "b": 0, "c": 2}


def test_bad_inputs_name_the_field() -> None:
    op = OpCost("a", 1.0, 1.0, 0, 0, 0)
    with pytest.raises(PartitionError, match=r"cut_bytes: expected N \+ 1 = 2"):
        PartitionProblem((op,), (0,), 1, 1)
    with pytest.raises(PartitionError, match="memory_budget: expected 2 values"):
        PartitionProblem((op,), (0, 0), 2, 1, memory_budget=(1.0,))
    with pytest.raises(PartitionError, match="schedule"):
        PartitionProblem((op,), (0, 0), 2, 1, schedule="zb")
    with pytest.raises(PartitionError, match="duplicates"):
        PartitionProblem((op, op), (0, 0, 0), 2, 1)
    with pytest.raises(PartitionError, match=r"OpCost\('a'\).param_bytes"):
        OpCost("a", 1.0, 1.0, 1.5, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match=r"OpCost\('a'\).fwd"):
        OpCost("a", -1.0, 1.0, 0, 0, 0)
    problem = PartitionProblem((op,), (0, 0), 2, 1)
    with pytest.raises(PartitionError, match="bounds: expected P \\+ 1 = 3"):
        evaluate(problem, (0, 1))
    with pytest.raises(PartitionError, match="non-decreasing"):
        evaluate(problem, (0, 2, 1))
    with pytest.raises(PartitionError, match="eps"):
        solve(problem, eps=-0.1)
    with pytest.raises(PartitionError, match=r"previous\['a'\]"):
        solve(problem, {"a": "stage0"})  # type: ignore[dict-item]


# ------------------------------------------------------------------ the tensor manager's memory model


def _managed(problem: PartitionProblem, memory, budget=None) -> PartitionProblem:
    return PartitionProblem(problem.ops, problem.cut_bytes, problem.num_stages, problem.num_microbatches,
                            problem.schedule, problem.bandwidth, problem.latency,
                            budget if budget is not None else problem.memory_budget, memory)


@pytest.mark.parametrize("seed", range(30))
def test_managed_memory_formula(seed: int) -> None:
    from pipeline.plan.activations import min_activation_memory
    from pipeline.plan.partition import ManagedMemory

    rng = np.random.default_rng(seed)
    base = small_problem(rng, int(rng.integers(1, 7)), int(rng.integers(1, 4)), integral=False)
    P, F = base.num_stages, in_flight(base.schedule.name, base.num_stages, base.num_microbatches)
    bounds = (0, *sorted(int(b) for b in rng.integers(0, base.num_ops + 1, size=P - 1)), base.num_ops)
    reserve = float(rng.integers(0, 10))
    default = evaluate(base, bounds)
    for optimizer in ("device", "host"):
        for acts in ("keep", "auto"):
            mm = ManagedMemory(optimizer, acts, reserve)
            part = evaluate(_managed(base, mm), bounds)
            assert part.stage_times == default.stage_times and part.bounds == default.bounds
            for s in range(P):
                ops = base.ops[bounds[s]:bounds[s + 1]]
                state = sum(2 * op.param_bytes + (op.optim_bytes if optimizer == "device" else 0) for op in ops)
                keep = F[s] * (sum(op.act_bytes for op in ops) + base.cut_bytes[bounds[s]])
                if acts == "keep":
                    assert part.stage_memory[s] == int(state + keep + reserve)
                else:
                    inputs = [0] + [base.cut_bytes[k] for k in range(bounds[s] + 1, bounds[s + 1])]
                    least = min_activation_memory(ops, inputs[:len(ops)], F[s], base.cut_bytes[bounds[s]])
                    # an achievable plan's memory: at least the least one, at most keeping everything
                    assert state + least + reserve <= part.stage_memory[s] + 1
                    transient = max((op.act_bytes for op in ops), default=0)
                    assert part.stage_memory[s] <= int(state + keep + reserve) + transient


@pytest.mark.parametrize("seed", range(20))
def test_managed_split_has_activation_plans_that_fit(seed: int) -> None:
    from pipeline.plan.activations import activation_memory, partition_activation_plans
    from pipeline.plan.partition import ManagedMemory

    rng = np.random.default_rng(100 + seed)
    loose = random_problem(rng, int(rng.integers(4, 12)), int(rng.integers(2, 5)), int(rng.integers(2, 9)))
    mm = ManagedMemory("host", "auto", reserve=1 << 20)
    keep_all = solve(_managed(loose, ManagedMemory("host", "keep", 1 << 20)))
    tight = max(keep_all.stage_memory) * 0.7
    problem = _managed(loose, mm, (tight,) * loose.num_stages)
    try:
        part = solve(problem)
    except PartitionError as e:
        assert e.short_by > 0
        return
    plans = partition_activation_plans(problem, part, host_bandwidth=1e10, overlap=1e-3)
    for s, plan in enumerate(plans):
        ops = problem.ops[part.bounds[s]:part.bounds[s + 1]]
        state = sum(2 * op.param_bytes for op in ops)
        assert state + plan.memory + (1 << 20) <= tight
        assert plan.choices == () or activation_memory(
            ops, [0] + [problem.cut_bytes[k] for k in range(part.bounds[s] + 1, part.bounds[s + 1])],
            plan.choices, in_flight(problem.schedule.name, problem.num_stages, problem.num_microbatches)[s],
            problem.cut_bytes[part.bounds[s]]) == plan.memory


def test_managed_memory_default_unchanged_and_shortfall() -> None:
    from pipeline.plan.partition import ManagedMemory

    rng = np.random.default_rng(7)
    problem = random_problem(rng, 10, 3, 4)
    assert solve(problem) == solve(_managed(problem, None))
    # the optimizer state on the host and activations planned: less memory than resident state
    dev = solve(_managed(problem, ManagedMemory("device", "keep")))
    host = solve(_managed(problem, ManagedMemory("host", "auto")))
    assert max(host.stage_memory) < max(dev.stage_memory)
    budget = 0.5 * min(solve(_managed(problem, ManagedMemory("host", "auto"),
                                      (math.inf,) * 3)).stage_memory)
    with pytest.raises(PartitionError, match=r"short by .* MiB \(\d+ bytes\)") as e:
        solve(_managed(problem, ManagedMemory("device", "keep"), (budget,) * 3))
    assert e.value.short_by > 0
    assert "optimizer='host'" in str(e.value) and "activations='auto'" in str(e.value)
    with pytest.raises(PartitionError, match="ManagedMemory.optimizer: expected 'device' or 'host'"):
        ManagedMemory("gpu")
    with pytest.raises(PartitionError, match=r"ManagedMemory.reserve: expected 3 values"):
        _managed(problem, ManagedMemory(reserve=(1.0, 2.0)))


@pytest.mark.parametrize("seed,N,P", [(seed, N, P) for seed in range(4) for N in range(0, 8) for P in range(1, 4)])
def test_arena_model_bounds_each_stage_by_its_ops_arena_bytes(seed: int, N: int, P: int) -> None:
    """With the manager's exact arena bytes per op, a stage's memory is its ops' arena bytes
    plus the reserve (no activations, no grads), the solver's split is brute force's among the
    splits that fit every stage's arena, and an arena no split fits says by how much."""
    from pipeline.plan.partition import ManagedMemory

    rng = np.random.default_rng([seed, N, P, 9])
    base = small_problem(rng, N, P, integral=seed % 2 == 0)
    arena = {op.op_id: int(rng.integers(0, 100)) for op in base.ops}
    reserve = tuple(float(rng.integers(0, 5)) for _ in range(P))
    mm = ManagedMemory("device", arena=arena, reserve=reserve)
    for b in all_bounds(N, P):
        part = evaluate(_managed(base, mm), b)
        assert part.stage_memory == tuple(int(sum(arena[op.op_id] for op in base.ops[b[s]:b[s + 1]]) + reserve[s])
                                          for s in range(P))
    total = sum(arena.values())
    budgets = tuple(float(rng.integers(0, total + 10)) for _ in range(P))
    problem = _managed(base, mm, budgets)
    expected, optimum = brute_force(problem, None, 0.0)
    if expected is None:
        with pytest.raises(PartitionError, match="short by") as info:
            solve(problem)
        assert info.value.short_by == pytest.approx(optimum)
        assert "optimizer='host'" in str(info.value) and "activations='auto'" not in str(info.value)
        return
    got = solve(problem)
    assert got == expected and got.fits_memory
    assert all(m <= b for m, b in zip(got.stage_memory, budgets))


def test_arena_model_names_an_op_without_arena_bytes() -> None:
    from pipeline.plan.partition import ManagedMemory

    problem = random_problem(np.random.default_rng(3), 4, 2, 2)
    with pytest.raises(PartitionError, match=r"ManagedMemory.arena: expected the arena bytes of every op, found none"):
        solve(_managed(problem, ManagedMemory(arena={}), (1e9, 1e9)))
    with pytest.raises(PartitionError, match=r"ManagedMemory.arena\['a'\]: expected non-negative bytes"):
        ManagedMemory(arena={"a": -1})
