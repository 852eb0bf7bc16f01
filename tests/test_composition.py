"""Every capability composes: cross-subnet windows, delayed and frozen shared ops, replicated
stages and a tensor-manager budget, the in-flight cap in bytes and gradient clipping, together,
compute the one-process run's bits.

The one stage executor (pipeline/executor.py) runs flushed steps and cross-subnet segments
alike, with ops moving as the schedule's state messages and the tensor manager pinning each
subnet's ops from its first forward to its update (the admission builder keeps the subnets in
flight within the arena). Each scenario mixes several settings that used to refuse each other;
the budget is the largest subnet's footprint (every stage's slice fits alone), less than half of
the supernet's op state, so ops are evicted and fetched back while several subnets are in
flight. One spawn per layout (P = 2, and the (2, 2) mesh), several scenarios each.
"""
from __future__ import annotations

import dataclasses

import pytest

from distributed import Scenario, arch_stream, assert_same_as_reference, build_graph, one_process, spawn

pytestmark = pytest.mark.dist

MIGRATING = {"eps": 0.0, "objective": "minmax"}  # follow every change of the optimum
STEPS = 8


def op_state_bytes(space: str, optim: str, sampler: str) -> tuple[int, int]:
    """(the largest footprint of a subnet this run trains, the whole supernet's op state), with
    the optimizer state on the device."""
    from pipeline import OptimConfig
    from pipeline.memory import MemorySettings, TensorManager

    graph = build_graph(space)
    tm = TensorManager(graph, 0, OptimConfig(name=optim), memory=MemorySettings(optimizer="device"))
    largest = max(tm.footprint(op.op_id for op in graph.active_ops(a))
                  for a in arch_stream(graph, 0, STEPS + 1, sampler))
    return largest, tm.footprint(slot.op_id for slot in graph.slots())


def budgeted(space: str, optim: str, sampler: str, fraction: float = 1.0, **memory) -> dict:
    """A budget of ``fraction`` of the largest subnet's footprint (below 1: the memory-aware
    planner splits each subnet so that every stage's slice fits)."""
    largest, whole = op_state_bytes(space, optim, sampler)
    budget = int(largest * fraction)
    assert budget < whole / 2, f"{space}: the test needs a budget below half of the supernet's op state"
    return {"device_budget_bytes": budget, **memory}


def scenarios(stages: int | None) -> list[Scenario]:
    """Settings that did not combine before the one executor, mixed."""
    mesh = {"stages": stages} if stages else {}

    def sc(space: str, window: int, shared: str, memory: dict | None, optimizer: str = "sgd",
           sampler: str = "fair", **kw) -> Scenario:
        extra = {**MIGRATING, **mesh, "window": window, "shared_ops": shared}
        return Scenario(space, "1f1b", steps=STEPS, segment=STEPS, optimizer=optimizer, sampler=sampler,
                        extra=extra, memory=memory or {}, **kw)

    if stages is None:  # one process per stage (P = 2)
        return [
            sc("transformer", 4, "delayed", budgeted("transformer", "sgd", "fair")),
            # a host that steps only part of a subnet's ops in time (memory.host_update_rate)
            sc("conv", 4, "exact", budgeted("conv", "adamw", "fair", optimizer="hybrid", host_update_rate=1e7),
               optimizer="adamw"),
            sc("conv", 1, "frozen", budgeted("conv", "sgd", "fair", optimizer="host"), eval_archs=1),
            sc("transformer", 4, "frozen", {"activations": "recompute"}),
            # a shared op mid-graph: "transition" changes stage between subnets, with its versions
            sc("resmlp", 4, "delayed", budgeted("resmlp", "sgd", "fair", fraction=0.7)),
            sc("resmlp", 1, "frozen", None, eval_archs=1),
            # the default hybrid placement: an op in use keeps the state it was fetched with, so the
            # admission counts it (two subnets' ops with their state would not fit here)
            sc("resmlp", 4, "frozen", budgeted("resmlp", "sgd", "fair", fraction=0.7)),
            # the in-flight cap in bytes and clipping's norm messages, with a budget
            with_extra(sc("conv", 4, "delayed", budgeted("conv", "sgd", "fair"), clip=0.5), inflight="bytes"),
            with_extra(sc("transformer", 3, "exact", budgeted("transformer", "adamw", "fair", optimizer="hybrid"),
                          optimizer="adamw", clip=0.5), inflight="bytes"),
        ]
    return [  # the (2, 2) mesh: two replicas of a 2-stage pipeline
        sc("transformer", 4, "delayed", None),
        sc("conv", 1, "exact", budgeted("conv", "sgd", "fair")),
        sc("transformer", 4, "exact", budgeted("transformer", "adamw", "fair", optimizer="hybrid",
                                                host_update_rate=1e8), optimizer="adamw"),
        sc("conv", 4, "frozen", budgeted("conv", "sgd", "fair", optimizer="host")),
        sc("conv", 4, "delayed", None),
        sc("resmlp", 4, "delayed", None, eval_archs=1),
        # the B/W split with replicas: a replica k > 0 keeps each W's contribution apart
        dataclasses.replace(sc("conv", 4, "delayed", None), schedule="zbh1"),
        dataclasses.replace(sc("transformer", 1, "exact", budgeted("transformer", "sgd", "fair")), schedule="zbh1"),
        with_extra(sc("conv", 4, "delayed", budgeted("conv", "sgd", "fair")), inflight="bytes"),
    ]


def with_extra(sc: Scenario, **extra) -> Scenario:
    return dataclasses.replace(sc, extra={**sc.extra, **extra})


def reference(sc: Scenario) -> dict:
    """The single-process run of ``sc``: the same shared-op mode, no layout, all resident."""
    extra = {k: v for k, v in sc.extra.items() if k != "stages"}
    return one_process(dataclasses.replace(sc, extra=extra, memory={}))


@pytest.mark.parametrize("world,stages", [(2, None), (4, 2)])
def test_every_combination_computes_the_one_process_bits(world: int, stages: int | None) -> None:
    scs = scenarios(stages)
    results, _, _ = spawn(world, scs, timeout_s=400)
    evicted = arrived = 0
    for sc, got in zip(scs, results):
        label = (f"{sc.space} window={sc.extra['window']} {sc.extra['shared_ops']} memory={sc.memory} "
                 f"world={world} stages={stages or world}")
        assert_same_as_reference(got, reference(sc), label)
        budget = sc.memory.get("device_budget_bytes")
        if budget:
            assert all(0 < p <= budget for p in got["resident_peak"]), f"{label}: {got['resident_peak']} vs {budget}"
            evicted += sum(got["evictions"])
            arrived += sum(got["arrived"])
            # memory.host_update_rate: auto (the default) is measured where hybrid plans ask, on every rank
            auto = sc.memory.get("optimizer", "hybrid") == "hybrid" and "host_update_rate" not in sc.memory
            assert all((r is not None and r > 0) == auto for r in got["host_rate"]), f"{label}: {got['host_rate']}"
    assert evicted > 0, "the budgets should force evictions"
    assert arrived > 0, "ops that move under a budget should land in the receiver's arena"


def test_a_mid_graph_shared_op_changes_stage() -> None:
    """The resmlp runs above would not cover moving shared ops if "transition" kept its stage."""
    from pipeline import PipelineSettings
    from pipeline.lookahead import LookaheadPlanner
    from pipeline.plan.costs import analytic_costs

    graph = build_graph("resmlp")
    planner = LookaheadPlanner(graph, 0, 2, 4, PipelineSettings(**MIGRATING, window=4, shared_ops="delayed"),
                               analytic_costs(graph, (1, 8, 8), 4, "sgd"), can_move_early=True, optim_name="sgd")
    planner.ensure(__import__("torch").zeros(16, 1, 8, 8), 4, training=True)
    owners = {slot.op_id: 0 for slot in graph.slots()}
    stages, prior = set(), None
    for arch in arch_stream(graph, 0, STEPS, "fair"):
        plan = planner.plan_with(arch, owners, prior)
        where = planner.placed(plan)
        stages.add(where["transition"])
        owners.update(where)
        prior = arch
    assert stages == {0, 1}, f"transition sat on stages {sorted(stages)} only"


def test_the_nccl_message_path_on_gloo() -> None:
    """The executor's NCCL path (pair streams in order: a receive posted at need, or in one batch
    with the sends before it) run over gloo, payload-only flushed steps and a cross-subnet
    window alike: the one-process bits."""
    scs = [Scenario("transformer", "1f1b", steps=4, extra=MIGRATING, eval_archs=1),
           Scenario("conv", "gpipe", steps=4, segment=4, extra=MIGRATING),
           Scenario("transformer", "1f1b", steps=6, segment=6, sampler="fair",
                    extra={**MIGRATING, "window": 4, "shared_ops": "delayed"})]
    results, _, _ = spawn(2, scs, timeout_s=300, env_extra={"PIPENAS_TEST_BATCHED": "1"})
    for sc, got in zip(scs, results):
        assert_same_as_reference(got, one_process(sc), f"{sc.space}/{sc.schedule} window={sc.extra.get('window', 1)}")
