"""The cross-subnet benchmark's accounting (simulated, deterministic: no clocks asserted)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cross_subnet import (  # noqa: E402
    NASPIPE_WINDOW, Space, build_space, figures, flush_figures, grid, plan_stream, simulated_rows, target, verdicts,
    weight_grad,
)
from pipeline.plan.costs import analytic_costs, subnet_problem  # noqa: E402
from pipeline.plan.placement import initial_owners, moves  # noqa: E402
from pipeline.plan.planners import DynamicPlanner  # noqa: E402
from search.samplers import make_sampler  # noqa: E402
from supernet.spaces import transformer  # noqa: E402

SMALL = dict(layers=8, width=64, microbatch=4, sample_shape=(16, 32),
             rates=dict(flops_per_s=1e12, bytes_per_s=1e11, overhead_s=1e-5), link=dict(latency_s=1e-5, bandwidth=1e9))


@pytest.fixture(scope="module")
def space() -> Space:
    return build_space(**SMALL)


@pytest.fixture(scope="module")
def rows(space: Space) -> list[dict]:
    return [r for sampler in ("uniform", "fair") for M in (1, 2)
            for r in simulated_rows(space, 4, M, sampler, subnets=12, seed=0)]


def _archs(space: Space, n: int, sampler: str = "fair"):
    s = make_sampler(sampler, space.graph.space(), 0)
    return [s.next() for _ in range(n)]


def test_ops_with_state_and_shared_ops() -> None:
    # the default candidates include identity, which has no parameters: it never conflicts
    graph = transformer.build(input_shape=(16, 32), num_classes=10, layers=3, width=16)
    table = analytic_costs(graph, (16, 32), 2, "sgd")
    sp = Space(graph, table, SMALL["link"], 1e11, 1e-5)
    ids = {s.op_id for s in graph.slots()}
    assert sp.stateful == {op for op in ids if not op.endswith("/identity")}
    assert sp.shared == {"stem", "head"}
    assert all(sp.update[op] == 5 * table.ops[op].param_bytes / 1e11 for op in ids)


def test_each_subnets_work_is_its_partition(space: Space) -> None:
    archs = _archs(space, 6)
    work, origin, state_time = plan_stream(space, archs, 4, 2)
    assert origin == {op: s for op, s in initial_owners(space.graph.slots(), 4).items() if op in space.stateful}
    assert state_time == {op: space.move[op] for op in origin}
    for arch, w in zip(archs, work):
        active = space.graph.active_ops(arch)
        ops = [space.table.ops[op.op_id] for op in active]
        assert sum(w.fwd) == pytest.approx(sum(c.fwd for c in ops))
        assert sum(w.bwd) == pytest.approx(sum(c.bwd for c in ops))
        # the weight gradient: half the backward of an op with parameters, nothing for one without
        assert sum(w.bwd_weight) == pytest.approx(sum(0.5 * c.bwd for c in ops if c.param_bytes > 0))
        assert all(0 <= x <= b for x, b in zip(w.bwd_weight, w.bwd))
        assert set().union(*w.uses) == {op.op_id for op in active} & space.stateful
        assert "stem" in w.uses[0] and "head" in w.uses[-1]  # the shared ops keep their stages
        assert len(w.send) == 3 and all(x >= SMALL["link"]["latency_s"] for x in w.send)
    # one partition per block: every subnet of a block splits at the same layers
    block, _, _ = plan_stream(space, archs, 4, 2, block=3)
    for k in range(0, 6, 3):
        sizes = {tuple(len(u) for u in w.uses) for w in block[k:k + 3]}
        assert len(sizes) == 1


@pytest.mark.parametrize("objective", ["step", "minmax"])
def test_the_stream_is_partitioned_with_the_planners_objective(space: Space, objective: str) -> None:
    # plan_stream's bounds are the runtime's planner's with that objective, chained through the owners
    archs = _archs(space, 6)
    got: list = []
    plan_stream(space, archs, 4, 2, bounds_out=got, objective=objective)
    planner, owners = DynamicPlanner(0.05, objective=objective), initial_owners(space.graph.slots(), 4)
    before = None
    for arch, bounds in zip(archs, got):
        active = space.graph.active_ops(arch)
        problem = subnet_problem(space.graph, active, space.table, 4, 2, "1f1b", SMALL["link"]["bandwidth"],
                                 SMALL["link"]["latency_s"])
        want = planner.plan(problem, {op.op_id: owners[op.op_id] for op in active}, before).bounds
        assert tuple(bounds) == tuple(want)
        for mv in moves(active, want, owners):
            owners[mv.op_id] = mv.dst
        before = frozenset(op.op_id for op in active)


def test_weight_grad_of_ops_with_and_without_parameters(space: Space) -> None:
    ops = space.table.ops.values()
    assert all(weight_grad(c) == (0.5 * c.bwd if c.param_bytes else 0.0) for c in ops)


def test_ratios_are_of_the_same_work(rows: list[dict]) -> None:
    for r in rows:
        if "cross_subnet" not in r["bench"] and r["bench"] not in ("naspipe_rule", "per_window_partition", "bw_split"):
            continue
        # the same actions on the same costs: busy time is the same, so the ratios agree
        assert r["over_flush"] == pytest.approx(r["utilisation"] / r["flush_bound"], rel=1e-9)
        assert r["over_flush_1f1b"] == pytest.approx(r["utilisation"] / r["flush_1f1b_utilisation"], rel=1e-9)
        assert 0 < r["flush_bound"] <= 1 and 0 < r["utilisation"] <= 1
        assert r["target_met"] == (r["utilisation"] >= r["target_utilisation"])
        assert r["mode"] == "simulated" and r["P"] == 4
    for r in rows:
        if r["bench"] == "per_window_partition":
            assert r["window"] == r["delay"] + 1
            (same,) = [x for x in rows if x["bench"] == "cross_subnet" and x["shared_ops"] == "delayed"
                       and x["M"] == r["M"] and x["sampler"] == "fair"]
            assert r["per_subnet_utilisation"] == same["utilisation"] and (r["window"], r["delay"]) == (
                same["window"], same["delay"])


def test_bw_split_rows_sit_beside_the_same_setting_without(rows: list[dict]) -> None:
    split = [r for r in rows if r["bench"] == "bw_split"]
    # one per fair/delayed setting: the main row's (eps 0.05, 1x cap) and each option's, and the
    # runtime's split (its default cap, ZB-H1's rule) beside the main row
    zb = "P on every stage (ZB-H1's rule: the runtime's default with the split)"
    assert sorted((r["M"], r["eps"], r["cap"]) for r in split) == sorted(
        [(M, e, f"{c}x 1F1B (P - s)") for M in (1, 2) for e, c in ((0.05, 1), (0.0, 1), (0.05, 2), (0.0, 2))]
        + [(M, 0.05, zb) for M in (1, 2)])
    for r in split:
        assert r["sampler"] == "fair" and r["shared_ops"] == "delayed" and r["split"] is True
        cap = "1x 1F1B (P - s)" if r["cap"] == zb else r["cap"]
        (same,) = [x for x in rows if x["bench"] in ("cross_subnet", "cross_subnet_options") and x["M"] == r["M"]
                   and x["sampler"] == "fair" and x["shared_ops"] == "delayed" and (x["eps"], x["cap"]) == (r["eps"],
                                                                                                       cap)]
        assert (r["unsplit_utilisation"], r["unsplit_window"], r["unsplit_delay"]) == (
            same["utilisation"], same["window"], same["delay"])
        assert r["flush_bound"] == same["flush_bound"]  # the same stream, the same baseline
        assert r["over_unsplit"] == pytest.approx(r["utilisation"] / r["unsplit_utilisation"], rel=1e-9)
        assert r["unsplit_target_met"] == (r["unsplit_utilisation"] >= r["target_utilisation"])
        assert 0 < r["flush_bound_split"] <= 1 and r["flush_bound_split"] >= r["flush_bound"] - 1e-12


def test_rows_cover_the_settings(rows: list[dict]) -> None:
    main = [(r["sampler"], r["M"], r["shared_ops"]) for r in rows if r["bench"] == "cross_subnet"]
    assert sorted(main) == sorted((s, M, m) for s in ("uniform", "fair") for M in (1, 2)
                                  for m in ("exact", "delayed", "frozen"))
    naspipe = [r for r in rows if r["bench"] == "naspipe_rule"]
    assert [(r["sampler"], r["window"], r["shared_ops"]) for r in naspipe] == [("uniform", NASPIPE_WINDOW,
                                                                                "frozen")] * 2
    options = {(r["M"], r["eps"], r["cap"]) for r in rows if r["bench"] == "cross_subnet_options"}
    assert options == {(M, e, f"{c}x 1F1B (P - s)") for M in (1, 2) for e, c in ((0.0, 1), (0.05, 2), (0.0, 2))}
    for r in rows:
        if r["shared_ops"] == "delayed" and r["bench"] != "naspipe_rule":
            assert r["window"] == r["delay"] + 1 and r["delay"] >= 1
        else:
            assert r["delay"] == 0


def test_window_one_is_the_flush_and_the_grid_stops_at_the_target(space: Space) -> None:
    work, origin, st = plan_stream(space, _archs(space, 8), 4, 1)
    flush = flush_figures(work, 1, origin, st)
    for mode in ("exact", "delayed", "frozen"):
        f = figures(work, 1, 1, mode, 1 if mode == "delayed" else 0, space.shared, origin, st)
        assert f["makespan_s"] == flush["flush_makespan_s"]
    # with one micro-batch, 1F1B's literal order is the only order
    assert flush["flush_1f1b_makespan_s"] == flush["flush_makespan_s"]
    assert grid(4, 1, "delayed", 8)[0] == (2, 1) and all(w <= 8 for w, _ in grid(4, 1, "frozen", 8))
    assert target(4, 1) == 0.90 and target(8, 1) == 0.85 and target(4, 4) == target(8, 4) == 0.95


def test_verdicts_judge_fair_delayed_rows_only(rows: list[dict]) -> None:
    v = verdicts(rows)
    judged = [r for r in rows if r["sampler"] == "fair" and r["shared_ops"] == "delayed"
              and r["bench"] in ("cross_subnet", "cross_subnet_options", "bw_split")]
    assert len(v) == len(judged)  # P = 4, M = 1 and 2: no throughput verdict (that is P = 4, M = 4)
    for line, r in zip(v, judged):
        assert line["figure"] == r["utilisation"] and line["met"] == r["target_met"]
        assert ("with the B/W split" in line["what"]) == (r["bench"] == "bw_split")
        if r["bench"] == "bw_split":
            assert line["without_split"] == r["unsplit_utilisation"]


def test_byte_caps_rows_hold_the_count_caps_peak_and_name_their_baseline(space: Space) -> None:
    archs = _archs(space, 12)
    bounds, kept = [], []
    plan_stream(space, archs, 4, 2, bounds_out=bounds, kept_out=kept)
    for arch, b, row in zip(archs, bounds, kept):
        active = space.graph.active_ops(arch)
        problem = subnet_problem(space.graph, active, space.table, 4, 2, "1f1b", SMALL["link"]["bandwidth"],
                                 SMALL["link"]["latency_s"])
        # the saved tensors of the stage's ops and the bytes live across the cut before it
        assert row == tuple(sum(space.table.ops[o.op_id].act_bytes for o in active[b[s]:b[s + 1]])
                            + problem.cut_bytes[b[s]] for s in range(4))
    got = [r for r in simulated_rows(space, 4, 2, "fair", subnets=12, seed=0, modes=("delayed",), options=False,
                                     bw_split=False, byte_caps=True) if r["bench"] == "byte_caps"]
    assert [r["split"] for r in got] == [False, True]
    for r in got:
        assert r["over_count_cap"] == pytest.approx(r["utilisation"] / r["count_cap_utilisation"])
        assert all(x >= 1.0 for x in r["activation_bytes_max_over_mean"])
    assert any(v["from"] == "byte_caps" and "count_cap" in v for v in verdicts(got))


def test_clip_rows_name_their_unclipped_baseline(space: Space) -> None:
    got = [r for r in simulated_rows(space, 4, 2, "fair", subnets=12, seed=0, modes=("delayed",), options=False,
                                     bw_split=False, clip=True) if r["bench"] == "clip"]
    assert [r["split"] for r in got] == [False, True]
    for r in got:
        assert r["over_unclipped"] == pytest.approx(r["utilisation"] / r["unclipped_utilisation"])
        assert r["unclipped_utilisation"] > 0 and r["unclipped_window"] >= 1
