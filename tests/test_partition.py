"""The partitioner: exact against brute force, migration-aware choice, budgets, baselines, planners."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.partition import (
    REL_SLACK, DynamicPlanner, EqualCountPlanner, OpCost, OraclePlanner, Partition, PartitionError,
    PartitionProblem, StaticPlanner, equal_count, evaluate, make_planner, random_problem, solve,
    stage_cost, static_bounds, time_solve,
)
from pipeline.schedule import in_flight


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
    flight = in_flight(problem.schedule, P, problem.num_microbatches)

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


def test_step_objective_is_never_worse_than_the_eps_tie_break() -> None:
    from pipeline.partition import STEP_GRID, predicted_step, solve_step

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(150):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        prev = {op.op_id: int(rng.integers(0, p.num_stages)) for op in p.ops}
        try:
            best = solve_step(p, prev)
        except PartitionError:
            with pytest.raises(PartitionError):
                solve(p, prev)
            continue
        assert best.fits_memory
        score = predicted_step(p, best, _move_seconds(p, best, prev))
        for eps in (e for e in STEP_GRID if math.isfinite(e)):
            other = solve(p, prev, eps)
            assert score <= predicted_step(p, other, _move_seconds(p, other, prev)) * (1 + 1e-9)
        checked += 1
    assert checked > 50


def test_step_objective_without_owners_is_balanced_at_least_as_well_as_the_grid_allows() -> None:
    from pipeline.partition import STEP_GRID, solve_step

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


def test_step_objective_with_the_schedule_is_never_worse_by_the_replayed_schedule() -> None:
    """Scored by the schedule itself, the choice beats every eps of the grid and staying put."""
    from pipeline.partition import STEP_GRID, _schedule, predicted_step, solve_step

    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(120):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        prev = {op.op_id: int(rng.integers(0, p.num_stages)) for op in p.ops}
        sched = _schedule(p.schedule, p.num_stages, p.num_microbatches)
        try:
            best = solve_step(p, prev, schedule=sched)
        except PartitionError:
            continue
        score = predicted_step(p, best, _move_seconds(p, best, prev), sched)
        for eps in (e for e in STEP_GRID if math.isfinite(e)):
            other = solve(p, prev, eps)
            assert score <= predicted_step(p, other, _move_seconds(p, other, prev), sched) * (1 + 1e-9)
        checked += 1
    assert checked > 40


def test_makespan_equals_the_simulators_step_time() -> None:
    from pipeline.schedule import build
    from pipeline.simulate import makespan, simulate

    rng = np.random.default_rng(5)
    for _ in range(100):
        P, M = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        sched = build(str(rng.choice(["gpipe", "1f1b"])), P, M)
        f, b, c = rng.random(P).tolist(), (2 * rng.random(P)).tolist(), (0.3 * rng.random(max(P - 1, 0))).tolist()
        assert makespan(sched, f, b, c) == simulate(sched, f, b, c).step_time


# ------------------------------------------------------- migration during the step before (busy)


def test_migration_wait_charges_busy_moves_in_full_and_early_ones_beyond_the_window() -> None:
    from pipeline.partition import migration_wait

    # 300 bytes over 3 ops at 100 B/s and 0.5 s per op: 4.5 s if all wait
    assert migration_wait(300, 3, 300, 3, 100.0, 0.5) == pytest.approx(4.5)
    assert migration_wait(300, 3, 300, 3, 100.0, 0.5, window=10.0) == pytest.approx(4.5)  # all busy
    assert migration_wait(300, 3, 0, 0, 100.0, 0.5, window=10.0) == 0.0  # all early, fits
    assert migration_wait(300, 3, 0, 0, 100.0, 0.5, window=4.0) == pytest.approx(0.5)  # spills
    # one busy op of 100 bytes waits (1.5 s); the other two take 3 s early, 1 s past the window
    assert migration_wait(300, 3, 100, 1, 100.0, 0.5, window=2.0) == pytest.approx(1.5 + 1.0)
    assert migration_wait(0, 0, 0, 0, 100.0, 0.5, window=0.0) == 0.0


def _wait_of(problem, part, previous, busy, schedule):
    from pipeline.partition import migration_wait, predicted_step

    assign = part.assignment([op.op_id for op in problem.ops])
    moving = [op for op in problem.ops if op.op_id in previous and previous[op.op_id] != assign[op.op_id]]
    waiting = [op for op in moving if busy is None or op.op_id in busy]
    pipe = predicted_step(problem, part, 0.0, schedule)
    size = lambda ops: sum(op.param_bytes + op.optim_bytes for op in ops)  # noqa: E731
    return pipe, migration_wait(size(moving), len(moving), size(waiting), len(waiting), problem.bandwidth,
                                problem.latency, window=pipe if busy is not None else 0.0)


def test_step_objective_with_every_op_busy_is_the_step_objective_without_busy() -> None:
    from pipeline.partition import _schedule, solve_step

    rng = np.random.default_rng(21)
    for _ in range(80):
        p = random_problem(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)))
        prev = {op.op_id: int(rng.integers(0, p.num_stages)) for op in p.ops}
        sched = _schedule(p.schedule, p.num_stages, p.num_microbatches)
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
    from pipeline.partition import _schedule

    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(150):
        N, P = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        p = random_problem(rng, N, P, bandwidth=float(rng.choice([1e9, 5e9])), latency=1e-4)
        prev = {op.op_id: int(rng.integers(0, P)) for op in p.ops}
        busy = frozenset(op.op_id for op in p.ops if rng.random() < 0.3)
        sched = _schedule(p.schedule, P, p.num_microbatches)
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
    from pipeline.partition import _schedule, predicted_step

    def problem(state_bytes: int) -> PartitionProblem:
        ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, state_bytes, 0, 0) for k in range(4))
        return PartitionProblem(ops, (1000,) * 5, 2, 8, "1f1b", 1e9, 1e-5)

    sched = _schedule("1f1b", 2, 8)
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
