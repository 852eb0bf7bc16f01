"""The tensor manager in every pipeline stage: with a per-stage device budget that forces
evictions every step, a pipelined run (gloo, P = 2 and 3, both schedules, all three spaces, ops
migrating between stages, from host memory too) computes the same bits as the all-resident
single-process reference, and no stage's device tier ever holds more than its budget."""
from __future__ import annotations

import pytest

from distributed import Scenario, assert_same_as_reference, one_process, run_scenario, spawn
from pipeline.memory import TensorManager
from test_memory import tight_budget

pytestmark = pytest.mark.dist

MIGRATING = {"eps": 0.0, "objective": "minmax"}


def budgeted(sc: Scenario, stages: int) -> Scenario:
    # a stage's slice fits (at most the largest subnet of the run, less with three stages),
    # the stage's share of the supernet does not
    budget = int(tight_budget(sc.space, sc.optimizer, sc.steps) * (1.0 if stages == 2 else 0.67))
    return Scenario(**{**sc.__dict__, "memory": {"device_budget_bytes": budget}})


PLAIN = [
    Scenario("transformer", "1f1b", steps=4, extra=MIGRATING),
    Scenario("conv", "gpipe", steps=4, optimizer="adamw", extra=MIGRATING),
    Scenario("cell", "1f1b", steps=4, extra=MIGRATING, eval_archs=1),
]


def reference(i: int) -> dict:
    return one_process(PLAIN[i])  # all resident


@pytest.mark.parametrize("stages", [2, 3])
def test_budgeted_stages_compute_the_reference_bits_within_their_budget(stages: int) -> None:
    """Both placements that let state stay home (``host``, ``hybrid``), in one spawn per P."""
    scenarios = [Scenario(**{**sc.__dict__, "memory": {**sc.memory, "optimizer": optimizer}})
                 for optimizer in ("host", "hybrid") for sc in (budgeted(sc, stages) for sc in PLAIN)]
    results, _, _ = spawn(stages, scenarios, timeout_s=300)
    for k, (sc, got) in enumerate(zip(scenarios, results)):
        optimizer = sc.memory["optimizer"]
        label = f"{sc.space}/{sc.schedule}/{sc.optimizer} P={stages} {optimizer}"
        if optimizer == "hybrid":  # ops the next subnet reuses stay on the device, the others are host-updated
            assert sum(got["host_updates"]) > 0 and sum(got["hits"]) > 0, f"{label}: both placements should be used"
        assert_same_as_reference(got, reference(k % len(PLAIN)), label)
        budget = sc.memory["device_budget_bytes"]
        assert all(0 < p <= budget for p in got["resident_peak"]), f"{label}: {got['resident_peak']} vs {budget}"
        assert sum(got["evictions"]) > 0, f"{label}: the budget should force evictions"
        # ops with state move; the cell space's short runs at P = 2 repartition only around stateless ops
        assert got["migrated"] > 0 or (sc.space, stages) == ("cell", 2), f"{label}: ops should migrate"


SWAPPED = [
    Scenario("transformer", "1f1b", steps=3, extra=MIGRATING, memory={"activations": "swap"}),
    Scenario("conv", "gpipe", steps=3, memory={"activations": "recompute"}),  # batch norm: swapped instead
    Scenario("cell", "1f1b", steps=3, optimizer="adamw", memory={"activations": "recompute"}),
    Scenario("transformer", "gpipe", steps=3, memory={"activations": "recompute"}),  # dropout: derived randomness
]


def kept(i: int) -> dict:
    return one_process(Scenario(**{**SWAPPED[i].__dict__, "memory": {}}))


def test_swapped_and_recomputed_activations_compute_the_same_bits_in_one_process() -> None:
    for i, sc in enumerate(SWAPPED):
        res = run_scenario(sc)
        policy = res.pop("engine").last_policy
        assert res["losses"] == kept(i)["losses"] and res["digest"] == kept(i)["digest"], sc
        assert policy.swapped_bytes > 0 or policy.recomputed_ops > 0, sc


@pytest.mark.parametrize("stages", [2, 3])
def test_swapped_and_recomputed_activations_compute_the_same_bits_in_stages(stages: int) -> None:
    results, _, _ = spawn(stages, SWAPPED, timeout_s=300)
    for i, (sc, got) in enumerate(zip(SWAPPED, results)):
        assert got["losses"] == kept(i)["losses"] and got["mb_losses"] == kept(i)["mb_losses"], sc
        assert got["digest"] == kept(i)["digest"], sc


# -- the planner knows the manager's budgets ---------------------------------------------------

def planned(sc: Scenario, stages: int, memory: dict) -> list:
    """The plans the engine makes for ``sc``'s steps (the lookahead planner is pure: the same
    chain of placements, steps before and memory model as in the engine)."""
    from distributed import arch_stream, build_graph, step_data
    from pipeline import MemorySettings, PipelineSettings
    from pipeline.lookahead import LookaheadPlanner
    from pipeline.memory import MemoryModel
    from pipeline.plan.placement import initial_owners
    from test_memory import optim_of

    graph = build_graph(sc.space)
    settings = MemorySettings(**memory)
    model = MemoryModel(settings)
    if settings.virtual:
        tm = TensorManager(graph, sc.seed, optim_of(sc.optimizer), memory=settings)
        model = MemoryModel(settings, (settings.device_budget_bytes,) * stages,
                            tm.footprints(slot.op_id for slot in graph.slots()))
        tm.close()
    planner = LookaheadPlanner(graph, sc.seed, stages, sc.microbatches,
                               PipelineSettings(schedule=sc.schedule, planner=sc.planner, **sc.extra), None,
                               True, sc.optimizer, model)
    x, _ = step_data(sc.seed, 0, sc.batch)
    planner.ensure(x, sc.batch // sc.microbatches, True)
    plans = []
    for _, plan in planner.chain(arch_stream(graph, sc.seed, sc.steps), initial_owners(graph.slots(), stages), None):
        for s in range(stages):  # what training asks of the plan (raises where no activation plan fits)
            plan.stage_activations(s)
        plans.append(plan)
    return plans


def least_feasible(sc: Scenario, stages: int, field_: str, hi: int, rel: float = 0.0, **memory) -> int:
    """The smallest value of ``memory.<field_>`` with which every step of ``sc`` can be planned
    (``hi`` must be one); with ``rel`` > 0, a feasible value within ``rel`` of it (planning is
    the cost: each try plans every step)."""
    def feasible(value: int) -> bool:
        try:
            planned(sc, stages, {**memory, field_: value})
            return True
        except ValueError:
            return False

    lo = 0  # infeasible
    while rel and hi >= 8 and feasible(hi // 8):  # most tries' budgets are far too large: come down fast
        hi //= 8
    if rel:
        lo = hi // 8 if hi >= 8 else 0
    while hi - lo > max(1, int(rel * hi)):
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


ARENA = Scenario("cell", "1f1b", steps=4, eval_archs=1)


def unconstrained_need(sc: Scenario, stages: int) -> int:
    """The arena the splits made without the bound need (the most any stage's active ops take)."""
    from distributed import build_graph
    from test_memory import optim_of

    tm = TensorManager(build_graph(sc.space), sc.seed, optim_of(sc.optimizer))
    return max(tm.footprint(op.op_id for op in sl.ops) for p in planned(sc, stages, {}) for sl in p.slices)


def test_the_split_fits_every_stage_arena_and_an_arena_too_small_stops_the_job() -> None:
    """The partitioner bounds each stage's active ops by its arena: at the least budget that
    plans every step (under what the splits made without the bound need, so the split moves)
    the run computes the reference bits within the budget; one byte less stops every rank
    with the shortfall."""
    least = least_feasible(ARENA, 2, "device_budget_bytes", tight_budget(ARENA.space, ARENA.optimizer, ARENA.steps))
    assert least < unconstrained_need(ARENA, 2)  # the bound changes the split
    ok = Scenario(**{**ARENA.__dict__, "memory": {"device_budget_bytes": least}})
    short = Scenario(**{**ARENA.__dict__, "memory": {"device_budget_bytes": least - 1}})
    results, _, _ = spawn(2, [ok], timeout_s=300)
    ref = run_scenario(ARENA)
    got = results[0]
    assert got["losses"] == ref["losses"] and got["digest"] == ref["digest"] and got["evals"] == ref["evals"]
    assert all(0 < p <= least for p in got["resident_peak"]), (got["resident_peak"], least)
    _, procs, _ = spawn(2, [short], timeout_s=120, expect_ok=False)
    for rank, p in enumerate(procs):
        assert p is not None and p.returncode != 0, f"rank {rank} should stop"
        assert "memory.device_budget_bytes: no split of subnet" in p.stderr and "short by 1 bytes" in p.stderr, \
            p.stderr[-3000:]


AUTO = [
    Scenario("transformer", "1f1b", steps=3, extra=MIGRATING),
    Scenario("conv", "gpipe", steps=3),
    Scenario("cell", "1f1b", steps=3, optimizer="adamw"),
]


def auto(sc: Scenario, stages: int) -> Scenario:
    """``sc`` with ``memory.activations=auto`` at (within 1/64 above) the least activation budget
    its plans meet: some stage then swaps or recomputes, which the test checks on the plans."""
    least = least_feasible(sc, stages, "activation_budget_bytes", 1 << 24, rel=1 / 64, activations="auto")
    return Scenario(**{**sc.__dict__, "memory": {"activations": "auto", "activation_budget_bytes": least}})


@pytest.mark.parametrize("stages", [2, 3])
def test_auto_activations_meet_their_budget_and_compute_the_same_bits(stages: int) -> None:
    scenarios = [auto(sc, stages) for sc in AUTO]
    for sc in scenarios:  # the plan: every stage within the budget, and not all keeping
        plans = planned(sc, stages, sc.memory)
        assert any(c != "keep" for p in plans for st in p.activations for c in st.values()), sc
    results, _, _ = spawn(stages, scenarios, timeout_s=300)
    for sc, got in zip(scenarios, results):
        ref = run_scenario(Scenario(**{**sc.__dict__, "memory": {}}))
        assert got["losses"] == ref["losses"] and got["mb_losses"] == ref["mb_losses"], sc
        assert got["digest"] == ref["digest"], sc
        assert sum(got["recomputed"]) + sum(got["swapped"]) > 0, sc


def test_auto_activations_in_one_process_and_a_budget_below_the_floor() -> None:
    sc = Scenario("transformer", "1f1b", steps=3)
    least = least_feasible(sc, 1, "activation_budget_bytes", 1 << 24, activations="auto")
    res = run_scenario(Scenario(**{**sc.__dict__, "memory": {"activations": "auto", "activation_budget_bytes": least}}))
    policy = res.pop("engine").last_policy
    ref = run_scenario(sc)
    assert res["losses"] == ref["losses"] and res["digest"] == ref["digest"]
    assert policy is not None and policy.swapped_bytes + policy.recomputed_ops > 0
    with pytest.raises(ValueError, match=r"memory.activation_budget_bytes: stage 0 .* short by \d+ bytes"):
        run_scenario(Scenario(**{**sc.__dict__, "memory": {"activations": "auto",
                                                            "activation_budget_bytes": least - 1}}))


def test_a_static_split_that_overflows_an_arena_names_the_budget() -> None:
    """The static planner does not move its split for the arena; a split that overflows it is an
    error naming the field, the planner and the shortfall (pure planning, no processes)."""
    from pipeline import MemoryBudgetError

    static = Scenario(**{**ARENA.__dict__, "planner": "static"})
    budget = least_feasible(ARENA, 2, "device_budget_bytes", tight_budget(ARENA.space, ARENA.optimizer, ARENA.steps))
    need = unconstrained_need(static, 2)
    assert budget < need  # the dynamic planner fits where the static split does not
    with pytest.raises(MemoryBudgetError, match=r"memory.device_budget_bytes: the static planner's split of "
                                                r"subnet .* short by \d+ bytes") as e:
        planned(static, 2, {"device_budget_bytes": budget})
    assert 0 < e.value.short_by <= need - budget
    planned(static, 2, {"device_budget_bytes": need})  # enough for every static split
