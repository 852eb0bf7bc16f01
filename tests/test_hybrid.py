"""Hybrid optimizer placement plans: the per-op program against exhaustive search, the reuse rule,
the host-capacity pass, and the residency plan that executes it."""
from __future__ import annotations

import itertools
import random

import pytest

from pipeline.plan.hybrid import HybridCosts, limit_host, op_runs, plan_hybrid, reuse_rule, shed_to_fit
from pipeline.plan.residency import next_use, plan_residency


def exhaustive(steps: list[int], w: int, s: int, host: float, costs: HybridCosts) -> float:
    """The least cost over every labelling of the uses: host, a new device run, or the device
    run of the use before (a run may not span a gap over ``max_gap``)."""
    best = float("inf")
    for labels in itertools.product(("host", "start", "more"), repeat=len(steps)):
        cost, run_start, ok = 0.0, None, True
        for k, (t, lab) in enumerate(zip(steps, labels)):
            if lab == "more":
                if run_start is None or (costs.max_gap is not None and t - steps[k - 1] > costs.max_gap):
                    ok = False
                    break
                continue
            if run_start is not None:  # the run before ends at the use before this one
                cost += 2 * (w + s) + costs.hold * (w + s) * (steps[k - 1] - run_start)
                run_start = None
            if lab == "host":
                cost += 2 * w + host
            else:
                run_start = t
        if not ok:
            continue
        if run_start is not None:
            cost += 2 * (w + s) + costs.hold * (w + s) * (steps[-1] - run_start)
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(80))
def test_the_per_op_program_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(30), rng.randint(1, 7)))
    w, s = rng.randint(1, 8), rng.randint(0, 16)
    costs = HybridCosts(hold=rng.choice([0.0, 0.05, 0.2, 1.0]), host_cost=float(rng.randint(0, 20)),
                        max_gap=rng.choice([None, 1, 2, 5]))
    cost, on_device = op_runs(steps, w, s, costs.host("op", s), costs)
    assert cost == pytest.approx(exhaustive(steps, w, s, costs.host("op", s), costs))
    assert len(on_device) == len(steps)  # one label per use


def test_the_reuse_rule_keeps_the_state_while_the_next_subnet_reuses_the_op() -> None:
    trace = [("a", "b"), ("a", "c"), ("c",), ("b",), ("a",), ("a",)]
    plan = plan_hybrid(trace, {o: 4 for o in "abc"}, {o: 8 for o in "abc"}, reuse_rule(1))
    # a: steps 0, 1 (a run), 4, 5 (a run); b: 0 and 3, three steps apart: home each time; c: 1, 2
    assert [sorted(s) for s in plan.on_device] == [["a"], ["a", "c"], ["c"], [], ["a"], ["a"]]
    assert [sorted(s) for s in plan.on_host] == [["b"], [], [], ["b"], [], []]
    wider = plan_hybrid(trace, {o: 4 for o in "abc"}, {o: 8 for o in "abc"}, reuse_rule(3))
    assert "b" in wider.on_device[0] and "b" in wider.on_device[3]
    assert plan.host_share == pytest.approx(2 / 8)


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_sum_of_per_op_optima(seed: int) -> None:
    rng = random.Random(500 + seed)
    ops = [f"o{k}" for k in range(6)]
    trace = [tuple(rng.sample(ops, rng.randint(1, 3))) for _ in range(rng.randint(3, 9))]
    w = {o: rng.randint(1, 5) for o in ops}
    s = {o: rng.randint(0, 10) for o in ops}
    costs = HybridCosts(hold=0.1, host_cost={o: float(rng.randint(0, 12)) for o in ops}, max_gap=2)
    plan = plan_hybrid(trace, w, s, costs)
    total = 0.0
    for o in ops:
        steps = [t for t, u in enumerate(trace) if o in u]
        if steps:
            total += exhaustive(steps, w[o], s[o], costs.host(o, s[o]), costs)
    assert plan.cost == pytest.approx(total)
    for t, u in enumerate(trace):  # every use placed exactly once
        assert plan.on_host[t] | plan.on_device[t] == set(u) and not plan.on_host[t] & plan.on_device[t]


def test_limit_host_moves_the_soonest_needed_host_uses_to_the_device() -> None:
    trace = [("a", "b", "c"), ("d",), ("b",), ("c",)]
    w = {o: 10 for o in "abcd"}
    plan = plan_hybrid(trace, w, {o: 20 for o in "abcd"}, reuse_rule(1))
    assert plan.on_host[0] == {"a", "b", "c"}
    capped = limit_host(plan, trace, w, [15.0, 100.0, 100.0, 100.0])
    # at most one op's weights on the host at step 0: b (needed at 2) and c (at 3) go to the device
    assert capped.on_host[0] == {"a"} and capped.on_device[0] == {"b", "c"}
    assert capped.on_host[1:] == plan.on_host[1:]
    with pytest.raises(ValueError, match="one capacity per step"):
        limit_host(plan, trace, w, [1.0])


@pytest.mark.parametrize("seed", range(30))
def test_the_residency_plan_executes_a_hybrid_placement(seed: int) -> None:
    """Host uses fetch only weights and leave when their step ends; device uses stay (dirty) and
    are hits while resident; the budget holds."""
    rng = random.Random(900 + seed)
    ops = [f"o{k}" for k in range(rng.randint(4, 9))]
    trace = [tuple(rng.sample(ops, rng.randint(1, 3))) for _ in range(rng.randint(5, 20))]
    w = {o: rng.randint(1, 4) for o in ops}
    full = {o: w[o] * 3 for o in ops}
    place = plan_hybrid(trace, w, {o: full[o] - w[o] for o in ops}, reuse_rule(rng.choice([1, 2])))
    budget = max(sum(full[o] for o in u) for u in trace) + rng.randint(0, 10)
    plan = plan_residency(trace, full, budget, "belady", prefetch_depth=rng.randint(0, 2),
                          on_host=place.on_host, host_sizes=w)
    future = next_use(trace)
    resident: dict[str, int] = {}
    for t, (need, st) in enumerate(zip(trace, plan.steps)):
        assert st.peak_bytes <= budget
        assert sorted(st.hits + st.prefetched + st.misses) == sorted(set(need))
        for op in st.dropped:  # only host uses, and only those that were not resident with their state
            assert op in place.on_host[t]
        for op in st.hits:  # a hit is a copy kept with its state from a device use
            assert resident[op] == full[op]
        for op in st.evict:
            resident.pop(op, None)
        for op in st.misses:
            resident[op] = w[op] if op in st.dropped else full[op]
        for op in st.prefetch:
            resident[op] = w[op] if op in place.on_host[future.after(op, t + 1)] else full[op]
        for op in st.dropped:
            resident.pop(op, None)
        assert sum(resident.values()) == st.resident_bytes
        for op in st.writeback:  # only copies with their state (updated on the device) go back
            assert any(op in place.on_device[u] or op in st_u.hits for u, st_u in enumerate(plan.steps[: t + 1]))


def test_shed_to_fit_sends_state_home_in_op_order_until_the_step_fits() -> None:
    trace = [("a", "b", "c"), ("a", "b", "c"), ("d",)]
    w = {o: 10 for o in "abcd"}
    s = {o: 20 for o in "abcd"}
    plan = plan_hybrid(trace, w, s, reuse_rule(1))
    assert plan.on_device[0] == {"a", "b", "c"}  # each reused by the next step: 90 bytes
    shed = shed_to_fit(plan, trace, w, s, 60)
    # a, then b go home (op order) until 30 + 20 + ... fits in 60: 90 -> 70 -> 50
    assert shed.on_host[0] == {"a", "b"} and shed.on_device[0] == {"c"}
    assert shed.on_host[1] == {"a", "b"} and shed.on_device[1] == {"c"}
    assert shed.on_host[2] == plan.on_host[2]
    assert shed_to_fit(plan, trace, w, s, 90) == plan
    with pytest.raises(ValueError, match="a plan of 2 steps, found 3"):
        shed_to_fit(plan, trace[:2], w, s, 60)


@pytest.mark.parametrize("seed", range(40))
def test_shed_to_fit_only_moves_device_uses_home_and_fits_what_can_fit(seed: int) -> None:
    rng = random.Random(1700 + seed)
    ops = [f"o{k}" for k in range(rng.randint(3, 8))]
    trace = [tuple(rng.sample(ops, rng.randint(1, min(4, len(ops))))) for _ in range(rng.randint(2, 15))]
    w = {o: rng.randint(1, 5) for o in ops}
    s = {o: rng.choice([1, 2]) * w[o] for o in ops}
    plan = plan_hybrid(trace, w, s, reuse_rule(rng.choice([1, 2])))
    cap = rng.randint(1, 40)
    shed = shed_to_fit(plan, trace, w, s, cap)
    for t, ops_t in enumerate(trace):
        assert plan.on_host[t] <= shed.on_host[t] and shed.on_device[t] <= plan.on_device[t]
        assert shed.on_host[t] | shed.on_device[t] == frozenset(ops_t)
        need = sum(w[o] + (0 if o in shed.on_host[t] else s[o]) for o in set(ops_t))
        assert need <= cap or not shed.on_device[t]
        if plan.on_device[t] == shed.on_device[t]:
            continue
        # what went home was needed: without the last op sent home the step would not fit
        last = max(plan.on_device[t] - shed.on_device[t])
        assert need + s[last] > cap
