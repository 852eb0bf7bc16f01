"""The runtime cost model (pipeline/plan/overhead.py) and the layout chooser it prices
(pipeline/plan/mesh.py layout_options, pipeline/layout.py price_layouts): pure, small cases."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline import PipelineSettings
from pipeline.layout import Layout, choose_layout, price_layouts
from pipeline.plan.admission import SubnetWork
from pipeline.plan.costs import analytic_costs
from pipeline.plan.mesh import LayoutOption, layout_options, meshes, pick, seconds_per_subnet
from pipeline.plan.overhead import PACKED_BUFFERS, RuntimeCosts, fit_line, stage_seconds, subnet_work
from pipeline.plan.partition import OpCost, PartitionProblem
from supernet.spaces import conv

GRAPH = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])


def test_fit_line_recovers_a_link_across_orders_of_magnitude() -> None:
    sizes = [4, 65536, 1 << 20, 4 << 20]
    a, b = fit_line(sizes, [5e-5 + n / 2e9 for n in sizes])
    assert a == pytest.approx(5e-5) and b == pytest.approx(1 / 2e9)
    assert fit_line([1, 2, 3], [3.0, 2.0, 1.0]) == (pytest.approx(1.3469, abs=1e-3), 0.0)  # falling: no cost per byte
    assert fit_line([1, 2], [0.5, 2.0]) == (0.0, pytest.approx(0.6))  # a negative intercept: through the origin
    with pytest.raises(ValueError, match="fit_line: expected as many sizes as times"):
        fit_line([1], [])


def test_runtime_costs_price_messages_updates_and_reductions() -> None:
    c = RuntimeCosts(update_s=1e-4, update_op_s=1e-5, update_byte_s=1e-9, latency_s=1e-4, bandwidth=1e9)
    assert c.message_s(1e6) == pytest.approx(1e-4 + 1e-3)
    assert c.message_s(0, buffers=3) == pytest.approx(3e-4)
    assert c.update_seconds(0, 0) == pytest.approx(1e-4)
    assert c.update_seconds(4, 1e6) == pytest.approx(1e-4 + 4e-5 + 1e-3)
    assert c.reduce_s(1e6, 1) == 0.0
    assert c.reduce_s(1e6, 2) == pytest.approx(2 * (PACKED_BUFFERS * 1e-4 + 1e-3))  # a hop there, the sum back
    assert c.reduce_s(1e6, 4, "fast") == pytest.approx(6 * (1e-4 + 0.25e-3))
    assert RuntimeCosts.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match=r"RuntimeCosts\.action_s: expected finite seconds >= 0"):
        RuntimeCosts(action_s=-1.0)
    with pytest.raises(ValueError, match=r"RuntimeCosts\.compute_scale: expected a positive finite number"):
        RuntimeCosts(compute_scale=0.0)


def _problem(n: int, fwd: float, param_bytes: int, stages: int = 1, micro: int = 4, cut: int = 0) -> PartitionProblem:
    ops = tuple(OpCost(f"op{i}", fwd, 2 * fwd, param_bytes, param_bytes, 0) for i in range(n))
    return PartitionProblem(ops=ops, cut_bytes=(cut,) * (n + 1), num_stages=stages, num_microbatches=micro)


def test_stage_seconds_add_the_action_and_scale_compute() -> None:
    c = RuntimeCosts(action_s=1e-3, latency_s=1e-4, bandwidth=1e9, compute_scale=2.0)
    fwd, bwd, send = stage_seconds(_problem(4, 1e-3, 0, 2, cut=10**6), (0, 2, 4), c)
    assert fwd == pytest.approx((5e-3, 5e-3)) and bwd == pytest.approx((9e-3, 9e-3))
    assert send == pytest.approx((1.1e-3,))
    assert stage_seconds(_problem(4, 1e-3, 0, 2, cut=10**6), (0, 2, 4), c, self_describing=True)[2] == \
        pytest.approx((1.2e-3,))  # a header first
    w = subnet_work(_problem(4, 1e-3, 1000, 2), (0, 2, 4), [frozenset({"op0"}), frozenset()],
                    RuntimeCosts(update_s=1e-4, step_s=1e-3, latency_s=0.0, bandwidth=1e6), replicas=2, extra_s=5e-3)
    # each stage's update: the optimizer and the reduction of 2000 bytes over 2; the subnet's
    # collectives and the extra spread over its 4 forwards
    assert w.update == pytest.approx((1e-4 + 2 * 2e-3,) * 2)
    assert w.fwd == pytest.approx((2e-3 + 6e-3 / 4,) * 2) and w.bwd == pytest.approx((4e-3,) * 2)


def _works(stages: int, replicas: int, n: int = 8, fwd: float = 1e-3, param_bytes: int = 1_000, subnets: int = 4,
           costs: RuntimeCosts = RuntimeCosts(latency_s=0.0), shared: frozenset = frozenset()) -> list[SubnetWork]:
    p = _problem(n, fwd, param_bytes, stages, 8 // replicas)
    per = n // stages
    bounds = tuple(range(0, n + 1, per))

    def uses(t: int) -> list[frozenset]:  # subnet t's own ops (as a fair round's), and the shared ones on stage 0
        return [frozenset({f"op{s * per}/{t}"} | (shared if s == 0 else frozenset())) for s in range(stages)]

    return [subnet_work(p, bounds, uses(t), costs, replicas) for t in range(subnets)]


def test_layout_options_price_bubble_reduction_and_window() -> None:
    assert meshes(4, 8, 4) == [(1, 4), (2, 2), (4, 1)] and meshes(4, 2, 4) == [(2, 2), (4, 1)]
    light = {(s, r): _works(s, r) for s, r in meshes(4, 8, 4)}
    opts = layout_options(light, 8, 64)
    assert [(o.stages, o.replicas, o.window) for o in opts] == [(1, 4, 1), (2, 2, 1), (4, 1, 1)]
    assert (pick(opts).stages, pick(opts).replicas) == (1, 4)  # tiny gradients: no bubble wins
    # one stage, 2 micro-batches of 24 ms (8 ops x 3 ms) per subnet, then the chain's 2 x 3 hops of 8 kB at 1 GB/s
    assert opts[0].step_s == pytest.approx(0.048 + 6 * 8e-6)
    assert opts[0].samples_per_s == pytest.approx(64 / opts[0].step_s)
    slow = RuntimeCosts(latency_s=0.0, bandwidth=1e6)
    heavy = {(s, r): _works(s, r, param_bytes=10**6, costs=slow) for s, r in meshes(4, 8, 4)}
    assert pick(layout_options(heavy, 8, 64)).stages == 4  # seconds to reduce: no replicas
    # delayed shared ops on stage 0 and nothing else shared: a window fills the flushed step's bubble
    shared = frozenset({"stem"})
    works = {(2, 1): _works(2, 1, subnets=8, shared=shared)}
    by_window = {o.window: o for o in layout_options(works, 8, 64, (1, 2, 4), delayed=shared, delay=1)}
    assert by_window[2].step_s < by_window[1].step_s and by_window[4].step_s <= by_window[2].step_s
    assert seconds_per_subnet(works[(2, 1)], 8, 1) == pytest.approx(by_window[1].step_s)
    # pipeline.schedule=zbh1: priced with the split, flushed (ZB-H1) and across subnets (the runtime's)
    for w in (1, 4):
        split = seconds_per_subnet(works[(2, 1)], 8, w, "zbh1", delayed=shared, delay=1)
        assert split <= seconds_per_subnet(works[(2, 1)], 8, w, delayed=shared, delay=1)
    assert seconds_per_subnet(works[(2, 1)], 8, 4, "zbh1", delayed=shared, delay=1) != by_window[4].step_s
    with pytest.raises(ValueError, match="pipeline.stages"):
        pick([])


def test_pick_prefers_fewer_stages_then_the_smaller_window_on_a_tie() -> None:
    opts = [LayoutOption(2, 1, 4, 1.0, 100.0), LayoutOption(2, 1, 1, 1.0, 99.5), LayoutOption(1, 2, 1, 1.0, 90.0)]
    assert pick(opts) == opts[1]
    assert pick(opts[:1] + opts[2:]) == opts[0]


def test_price_layouts_on_a_real_space_follows_the_settings() -> None:
    table = analytic_costs(GRAPH, (1, 8, 8), 16)
    costs = RuntimeCosts(latency_s=1e-4, bandwidth=1e9)
    free = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"))
    assert [(o.stages, o.replicas, o.window) for o in free] == [(1, 2, 1), (2, 1, 1)]  # exact shared ops: window 1
    delayed = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto", window="auto",
                                                                             shared_ops="delayed"))
    assert [(o.stages, o.window) for o in delayed] == [(1, 1), (2, 1), (2, 2), (2, 4), (2, 8)]
    pinned = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages=2, window="auto",
                                                                            shared_ops="frozen"))
    assert {o.stages for o in pinned} == {2}
    # the same inputs price the same (every rank chooses alike); the planning cost is charged only
    # where no core is spare
    again = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"))
    assert again == free
    charged = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"), plan_s={2: 0.1}, cpus=2)
    spare = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"), plan_s={2: 0.1}, cpus=8)
    assert charged[1].step_s > free[1].step_s + 0.02 and spare == free  # (bubbles absorb some of it)
    assert charged[0] == free[0]  # one stage plans nothing worth charging


def test_choose_layout_in_one_process_measures_nothing() -> None:
    from pipeline.memory import OptimConfig

    got = choose_layout(PipelineSettings(stages="auto", window="auto", shared_ops="delayed"), None, 0, 1, 4, GRAPH,
                        OptimConfig(), (1, 8, 8), 64, "cpu")
    assert got == (Layout(1, 1, None, 1), None, None)
    assert choose_layout(PipelineSettings(), None, 0, 1, 4, GRAPH, OptimConfig(), (1, 8, 8), 64, "cpu") == \
        (Layout(1, 1), None, None)
    assert Layout(1, 2, 123.45, 1).to_json() == {"stages": 1, "replicas": 2, "window": 1,
                                                  "predicted_samples_per_s": 123.5, "costs": None, "options": []}


def test_window_auto_is_accepted_and_never_cross_with_exact_shared_ops() -> None:
    assert not PipelineSettings(window="auto").cross
    assert PipelineSettings(window="auto", shared_ops="delayed").cross
    with pytest.raises(ValueError, match=r"pipeline\.window: expected an integer >= 1"):
        PipelineSettings(window="wide")


def test_the_sample_of_subnets_is_scaled_to_the_space() -> None:
    """The few subnets priced stand for the space: a sample heavier than the space's mean is
    scaled down, a lighter one up, and every option alike (the pick does not move)."""
    import random

    from pipeline.layout import _sample_factor

    table = analytic_costs(GRAPH, (1, 8, 8), 16)
    space = GRAPH.space()
    archs = [space.random(random.Random(k)) for k in range(64)]

    def compute(arch) -> float:
        return sum(table.ops[op.op_id].fwd + table.ops[op.op_id].bwd for op in GRAPH.active_ops(arch))

    heavy, light = max(archs, key=compute), min(archs, key=compute)
    assert compute(heavy) > compute(light)
    assert _sample_factor(GRAPH, table, [heavy], random.Random(0)) < 1 < _sample_factor(GRAPH, table, [light],
                                                                                         random.Random(0))
    assert _sample_factor(GRAPH, table, [heavy, light], random.Random(0)) == pytest.approx(
        _sample_factor(GRAPH, table, [light, heavy], random.Random(0)))
    costs = RuntimeCosts(latency_s=1e-4, bandwidth=1e9)
    opts = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"))
    ratio = opts[0].step_s / opts[1].step_s
    import pipeline.layout as layout

    real = layout._sample_factor
    try:  # the same options unscaled: the same ratios between them
        layout._sample_factor = lambda *a: 1.0
        raw = price_layouts(GRAPH, table, costs, 2, 4, 64, PipelineSettings(stages="auto"))
    finally:
        layout._sample_factor = real
    assert raw[0].step_s / raw[1].step_s == pytest.approx(ratio)
    assert opts[0].samples_per_s * opts[0].step_s == pytest.approx(raw[0].samples_per_s * raw[0].step_s)


def test_byte_caps_are_priced_as_the_runtime_runs_them() -> None:
    """``pipeline.inflight=bytes``: the chooser prices cross-subnet schedules with the byte cap
    (flushed steps have no cap to change); subnets that keep the same bytes get the count cap's."""
    shared = frozenset({"stem"})
    works = _works(2, 1, subnets=8, shared=shared)
    count = seconds_per_subnet(works, 8, 4, delayed=shared, delay=1)
    assert seconds_per_subnet(works, 8, 4, delayed=shared, delay=1, kept=[(100, 100)] * 8) == count
    table = analytic_costs(GRAPH, (1, 8, 8), 16)
    costs = RuntimeCosts(latency_s=1e-4, bandwidth=1e9)
    settings = PipelineSettings(stages=2, window="auto", shared_ops="delayed")
    by_count = price_layouts(GRAPH, table, costs, 2, 4, 64, settings)
    by_bytes = price_layouts(GRAPH, table, costs, 2, 4, 64, dataclasses.replace(settings, inflight="bytes"))
    assert [(o.stages, o.window) for o in by_bytes] == [(o.stages, o.window) for o in by_count]
    assert by_bytes[0] == by_count[0]  # window 1: flushed
    assert any(b.step_s != c.step_s for b, c in zip(by_bytes[1:], by_count[1:])), "the byte cap priced nothing"
