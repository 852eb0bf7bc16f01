"""Planners: the step objective (migration as the runtime makes it), baselines, make_planner."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.plan.partition import OpCost, PartitionError, PartitionProblem, evaluate, random_problem, solve
from pipeline.plan.planners import (
    DynamicPlanner, EqualCountPlanner, OraclePlanner, StaticPlanner, equal_count, make_planner, solve_step,
    static_bounds, time_solve,
)
from test_partition import all_bounds


def test_equal_count() -> None:
    ops = tuple(OpCost(f"op{k}", 1.0, 1.0, 0, 0, 0) for k in range(10))
    assert equal_count(PartitionProblem(ops, (0,) * 11, 3, 1)).bounds == (0, 4, 7, 10)
    assert equal_count(PartitionProblem(ops[:2], (0,) * 3, 4, 1)).bounds == (0, 1, 2, 2, 2)
    assert equal_count(PartitionProblem(ops[:8], (0,) * 9, 4, 1)).bounds == (0, 2, 4, 6, 8)
    part = equal_count(PartitionProblem(ops, (0,) * 11, 3, 1, memory_budget=(0.0, 0.0, 0.0)))
    assert part.stage_times == (8.0, 6.0, 6.0)
    assert part.fits_memory  # zero bytes everywhere fit a zero budget
    assert not equal_count(PartitionProblem(ops[:1], (1, 1), 1, 1, memory_budget=(0.0,))).fits_memory


def test_planners() -> None:
    rng = np.random.default_rng(5)
    problem = random_problem(rng, 12, 3)
    owners = {op.op_id: k % 3 for k, op in enumerate(problem.ops)}
    assert make_planner("dynamic", eps=0.1).plan(problem, owners) == solve(problem, owners, 0.1)
    assert isinstance(make_planner("dynamic"), DynamicPlanner)
    assert make_planner("equal").plan(problem, owners) == equal_count(problem, owners)
    oracle = make_planner("oracle").plan(problem, owners)
    assert oracle.bounds == solve(problem).bounds
    assert oracle.moved_bytes == evaluate(problem, oracle.bounds, owners).moved_bytes  # real moves reported
    assert isinstance(make_planner("oracle"), OraclePlanner) and isinstance(make_planner("equal"), EqualCountPlanner)

    static = StaticPlanner.from_problem(problem)
    assert static.bounds == static_bounds(problem) == solve(problem).bounds
    assert static.plan(problem, owners) == evaluate(problem, static.bounds, owners)
    assert make_planner("static", bounds=(0, 4, 8, 12)).plan(problem).bounds == (0, 4, 8, 12)
    shares = make_planner("static", fractions=(1, 1, 2))
    assert shares.plan(problem).bounds == (0, 3, 6, 12)
    with pytest.raises(PartitionError, match="N=12.*N=5"):
        static.plan(random_problem(rng, 5, 3))
    with pytest.raises(PartitionError, match=r"\['dynamic', 'equal', 'oracle', 'static'\].*'greedy'"):
        make_planner("greedy")
    with pytest.raises(PartitionError, match="planner 'equal': bad options"):
        make_planner("equal", eps=0.1)
    with pytest.raises(PartitionError, match="exactly one of"):
        StaticPlanner()


def test_time_solve_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    median = time_solve(num_ops=50, num_stages=8, repeats=5)
    assert median > 0  # a smoke run: never assert wall-clock figures
    with capsys.disabled():
        print(f"\nsolve(N=50, P=8) median {median * 1e3:.2f} ms")


# ------------------------------------------------------------------ step-time-aware objective


def _move_seconds(problem, part, previous):
    assign = part.assignment([op.op_id for op in problem.ops])
    return sum(problem.latency + (op.param_bytes + op.optim_bytes) / problem.bandwidth
               for op in problem.ops if op.op_id in previous and previous[op.op_id] != assign[op.op_id])


@pytest.mark.parametrize("replayed", [False, True])
def test_step_objective_is_never_worse_than_the_eps_tie_break(replayed: bool) -> None:
    """Scored by its own measure (the 1F1B/GPipe formula, or the schedule replayed), the choice
    beats every eps of the grid (and so staying put where that is within the grid)."""
    from pipeline.plan.planners import STEP_GRID, predicted_step, solve_step

    rng = np.random.default_rng(11 if replayed else 7)
    checked = 0
    for _ in range(150):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        prev = {op.op_id: int(rng.integers(0, p.num_stages)) for op in p.ops}
        sched = p.schedule if replayed else None
        try:
            best = solve_step(p, prev, schedule=sched)
        except PartitionError:
            with pytest.raises(PartitionError):
                solve(p, prev)
            continue
        assert best.fits_memory
        score = predicted_step(p, best, _move_seconds(p, best, prev), sched)
        for eps in (e for e in STEP_GRID if math.isfinite(e)):
            other = solve(p, prev, eps)
            assert score <= predicted_step(p, other, _move_seconds(p, other, prev), sched) * (1 + 1e-9)
        checked += 1
    assert checked > 40


def test_step_objective_without_owners_is_balanced_at_least_as_well_as_the_grid_allows() -> None:
    from pipeline.plan.planners import STEP_GRID, solve_step

    rng = np.random.default_rng(3)
    for _ in range(50):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        try:
            opt = solve(p)
        except PartitionError:
            continue
        assert solve_step(p, grid=STEP_GRID[:-1]).max_time <= (1 + max(STEP_GRID[:-1])) * opt.max_time * (1 + 1e-9)


def test_dynamic_planner_objective_is_validated() -> None:
    assert make_planner("dynamic", objective="step").objective == "step"
    with pytest.raises(PartitionError, match="objective"):
        make_planner("dynamic", objective="fastest")


def test_makespan_equals_the_simulators_step_time() -> None:
    from pipeline.plan.schedule import build
    from pipeline.plan.simulate import makespan, simulate

    rng = np.random.default_rng(5)
    for _ in range(100):
        P, M = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        sched = build(str(rng.choice(["gpipe", "1f1b"])), P, M)
        f, b, c = rng.random(P).tolist(), (2 * rng.random(P)).tolist(), (0.3 * rng.random(max(P - 1, 0))).tolist()
        assert makespan(sched, f, b, c) == simulate(sched, f, b, c).step_time


# ------------------------------------------------------- migration during the step before (busy)


def test_migration_wait_charges_busy_moves_in_full_and_early_ones_beyond_the_window() -> None:
    from pipeline.plan.planners import migration_wait

    # 300 bytes over 3 ops at 100 B/s and 0.5 s per op: 4.5 s if all wait
    assert migration_wait(300, 3, 300, 3, 100.0, 0.5) == pytest.approx(4.5)
    assert migration_wait(300, 3, 300, 3, 100.0, 0.5, window=10.0) == pytest.approx(4.5)  # all busy
    assert migration_wait(300, 3, 0, 0, 100.0, 0.5, window=10.0) == 0.0  # all early, fits
    assert migration_wait(300, 3, 0, 0, 100.0, 0.5, window=4.0) == pytest.approx(0.5)  # spills
    # one busy op of 100 bytes waits (1.5 s); the other two take 3 s early, 1 s past the window
    assert migration_wait(300, 3, 100, 1, 100.0, 0.5, window=2.0) == pytest.approx(1.5 + 1.0)
    assert migration_wait(0, 0, 0, 0, 100.0, 0.5, window=0.0) == 0.0


def _wait_of(problem, part, previous, busy, schedule):
    from pipeline.plan.planners import migration_wait, predicted_step

    assign = part.assignment([op.op_id for op in problem.ops])
    moving = [op for op in problem.ops if op.op_id in previous and previous[op.op_id] != assign[op.op_id]]
    waiting = [op for op in moving if busy is None or op.op_id in busy]
    pipe = predicted_step(problem, part, 0.0, schedule)
    size = lambda ops: sum(op.param_bytes + op.optim_bytes for op in ops)  # noqa: E731
    return pipe, migration_wait(size(moving), len(moving), size(waiting), len(waiting), problem.bandwidth,
                                problem.latency, window=pipe if busy is not None else 0.0)


def test_step_objective_with_every_op_busy_is_the_step_objective_without_busy() -> None:
    from pipeline.plan.planners import solve_step

    rng = np.random.default_rng(21)
    for _ in range(80):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        prev = {op.op_id: int(rng.integers(0, p.num_stages)) for op in p.ops}
        sched = p.schedule
        everything = frozenset(op.op_id for op in p.ops)
        try:
            expected = solve_step(p, prev, schedule=sched)
        except PartitionError:
            continue
        assert solve_step(p, prev, schedule=sched, busy=everything) == expected


def test_step_objective_with_busy_ops_beats_staying_put_and_is_within_eps() -> None:
    """Brute force over every split: the choice fits memory, stays within (1 + eps) of the optimum
    and, by the replayed schedule plus the migration the step waits for, is never worse than any
    split that moves nothing."""

    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(150):
        N, P = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        p = random_problem(rng, N, P, bandwidth=float(rng.choice([1e9, 5e9])), latency=1e-4)
        prev = {op.op_id: int(rng.integers(0, P)) for op in p.ops}
        busy = frozenset(op.op_id for op in p.ops if rng.random() < 0.3)
        sched = p.schedule
        eps = float(rng.choice([0.0, 0.05, 0.2]))
        try:
            opt = solve(p)
        except PartitionError:
            continue
        choice = DynamicPlanner(eps, objective="step").plan(p, prev, busy)
        assert choice.fits_memory and choice.max_time <= (1 + eps) * opt.max_time * (1 + 1e-9)
        score = sum(_wait_of(p, choice, prev, busy, sched))
        for bounds in all_bounds(N, P):
            other = evaluate(p, bounds, prev)
            if other.moved_bytes == 0 and other.max_time <= (1 + eps) * opt.max_time * (1 + 1e-9):
                assert score <= sum(_wait_of(p, other, prev, busy, sched)) * (1 + 1e-9)
        checked += 1
    assert checked > 60


def test_moves_that_can_run_during_the_step_before_are_worth_a_better_balance() -> None:
    """Owners 3:1 on two stages. Moving one op costs more than the balance gains when the step
    waits for it, and nothing when it moves during the step before (it fits in that step)."""
    from pipeline.plan.planners import predicted_step
    from pipeline.plan.schedule import build

    def problem(state_bytes: int) -> PartitionProblem:
        ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, state_bytes, 0, 0) for k in range(4))
        return PartitionProblem(ops, (1000,) * 5, 2, 8, "1f1b", 1e9, 1e-5)

    sched = build("1f1b", 2, 8)
    prev = {"op0": 0, "op1": 0, "op2": 0, "op3": 1}
    probe = problem(0)
    stay, balanced = evaluate(probe, (0, 3, 4), prev), evaluate(probe, (0, 2, 4), prev)
    gain = predicted_step(probe, stay, 0.0, sched) - predicted_step(probe, balanced, 0.0, sched)
    window = predicted_step(probe, balanced, 0.0, sched)
    assert 0 < gain < window
    move_s = (gain + window) / 2  # dearer than the gain, cheaper than the step before
    p = problem(int(move_s * 1e9))
    planner = DynamicPlanner(0.5, objective="step")
    assert planner.plan(p, prev).bounds == (0, 3, 4)  # every move waits: stay put
    assert planner.plan(p, prev, busy=frozenset({"op3"})).bounds == (0, 2, 4)  # op2 moves early
    assert planner.plan(p, prev, busy=frozenset({"op2"})).bounds == (0, 3, 4)  # op2 is in use: stay


@pytest.mark.parametrize("seed,N", [(seed, N) for seed in range(6) for N in range(0, 7)])
def test_one_stage_is_every_op_or_the_shortfall_for_both_objectives(seed: int, N: int) -> None:
    """At one stage (a data-parallel run plans every subnet so) both solvers return the only
    partition, every op on the stage, with its figures against the owners, where it fits, and
    otherwise the shortfall the brute force finds; the step objective with busy ops too."""
    from test_partition import brute_force, random_previous, small_problem

    rng = np.random.default_rng([seed, N, 1])
    problem = small_problem(rng, N, 1, integral=seed % 2 == 0)
    previous = random_previous(rng, problem)
    expected, optimum = brute_force(problem, previous, 0.0)
    busy = frozenset(op.op_id for op in problem.ops[::2])
    for solver in (lambda: solve(problem, previous), lambda: solve_step(problem, previous),
                   lambda: solve_step(problem, previous, busy=busy)):
        if expected is None:
            with pytest.raises(PartitionError, match="short by") as info:
                solver()
            assert info.value.short_by == pytest.approx(optimum)
        else:
            assert solver() == expected == evaluate(problem, (0, N), previous)
