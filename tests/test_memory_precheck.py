"""The memory pre-check (pipeline/feasibility.py): the least device and activation budgets it
reports are exactly the engine's and the planner's thresholds (exhaustively on small spaces),
the app fails on one byte less before writing anything, a run at the threshold trains, and the
command line exits 2 with one line naming the field and the value."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from pathlib import Path

import pytest
import torch

from pipeline import LrSchedule, MemoryBudgetError, PipelineSettings, ReferenceEngine
from pipeline.feasibility import check_memory
from pipeline.lookahead import LookaheadPlanner
from pipeline.memory import MemoryModel, MemorySettings, OptimConfig, TensorManager
from pipeline.memory.sizing import largest_subnet, op_footprints
from pipeline.plan.activations import ActivationError
from pipeline.plan.costs import CostTable, analytic_costs
from pipeline.plan.placement import initial_owners
from search.app import _sampler, prepare, run
from search.config import ConfigError, build_data, build_space, load_config
from supernet import Arch, OpSpec, SupernetGraph
from tests.cli_driver import Case, run_cases
from tests.test_app import TINY, TINY_CONV, make_cfg

SGD = OptimConfig(name="sgd", lr=0.05, momentum=0.9)
CPU = torch.device("cpu")
SHAPE, BATCH, M = (8,), 8, 2  # the small graphs' sample shape, batch and micro-batches


def small_graph(seed: int) -> SupernetGraph:
    """A chain of three choice slots between a fixed stem and head, candidates of random widths
    and a ``zero`` op (a cell space's "no edge"), so that sizes differ and no order is special."""
    gen = torch.Generator().manual_seed(seed)

    def width() -> int:
        return int(torch.randint(1, 9, (1,), generator=gen)) * 8

    g = SupernetGraph(f"small{seed}")
    prev = g.add_fixed("stem", OpSpec.of("linear", d_in=8, d_out=8), ["input"])
    for i in range(3):
        cands = {"a": OpSpec.of("mlp", d=8, hidden=width()), "b": OpSpec.of("mlp", d=8, hidden=width()),
                 "z": OpSpec.of("zero")}
        prev = g.add_choice(f"l{i}", cands, [prev])
    g.add_fixed("head", OpSpec.of("linear", d_in=8, d_out=4), [prev])
    return g


def every_arch(graph: SupernetGraph) -> list[Arch]:
    space = graph.space()
    return [Arch(zip(space.labels, values)) for values in
            itertools.product(*(space.choice(label).values for label in space.labels))]


def no_sampling() -> Arch:
    raise AssertionError("the device budget alone needs no training stream")


def device_need(graph: SupernetGraph, memory: MemorySettings, **pipelined) -> int:
    """The least device budget the pre-check reports (from its error at a budget of 1 byte)."""
    with pytest.raises(MemoryBudgetError) as e:
        check_memory(graph, 0, SGD, dataclasses.replace(memory, device_budget_bytes=1), CPU, SHAPE,
                     BATCH, M, no_sampling, 4, **pipelined)
    return e.value.needed


# -- the device budget -----------------------------------------------------------------------

@pytest.mark.parametrize("optim, momentum", [("sgd", 0.9), ("sgd", 0.0), ("adamw", 0.9)])
@pytest.mark.parametrize("placement", ["device", "host", "hybrid"])
def test_op_footprints_are_the_tensor_managers(optim: str, momentum: float, placement: str) -> None:
    graph = small_graph(0)
    opt, memory = OptimConfig(name=optim, lr=0.01, momentum=momentum), MemorySettings(optimizer=placement)
    tm = TensorManager(graph, 0, opt, memory=memory)
    ids = [s.op_id for s in graph.slots()]
    assert op_footprints(graph, 0, opt, CPU, memory) == tm.footprints(ids)
    assert op_footprints(graph, 0, opt, torch.device("cuda"), memory) != tm.footprints(ids)  # 512-byte alignment
    tm.close()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("placement", ["device", "hybrid"])
def test_one_process_device_threshold_is_the_largest_subnet_of_the_space(seed: int, placement: str) -> None:
    graph = small_graph(seed)
    memory = MemorySettings(optimizer=placement)
    tm = TensorManager(graph, 0, SGD, memory=memory)
    sizes = {arch: tm.footprint(op.op_id for op in graph.active_ops(arch)) for arch in every_arch(graph)}
    tm.close()
    need = device_need(graph, memory)
    assert need == max(sizes.values()) == sizes[largest_subnet(graph, op_footprints(graph, 0, SGD, CPU, memory))]
    check_memory(graph, 0, SGD, MemorySettings(device_budget_bytes=need, optimizer=placement), CPU, SHAPE, BATCH, M,
                 no_sampling, 4)
    with pytest.raises(MemoryBudgetError, match=rf"^memory\.device_budget_bytes: the largest subnet .* raise "
                                                rf"memory\.device_budget_bytes to at least {need}$"):
        check_memory(graph, 0, SGD, MemorySettings(device_budget_bytes=need - 1, optimizer=placement), CPU, SHAPE,
                     BATCH, M, no_sampling, 4)
    # the engine's own check at start-up agrees
    ReferenceEngine(graph, 0, SGD, M, LrSchedule(0.05, 4), memory=MemorySettings(device_budget_bytes=need,
                                                                                  optimizer=placement)).close()
    with pytest.raises(MemoryBudgetError, match=f"to at least {need}$"):
        ReferenceEngine(graph, 0, SGD, M, LrSchedule(0.05, 4),
                        memory=MemorySettings(device_budget_bytes=need - 1, optimizer=placement))


def brute_min_max(sizes: list[int], stages: int) -> int:
    """min over contiguous splits into ``stages`` parts (empty parts allowed) of the largest part."""
    n = len(sizes)
    return min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations_with_replacement(range(n + 1), stages - 1))


@functools.lru_cache(maxsize=None)
def _costs(graph: SupernetGraph) -> CostTable:
    """The graph's analytic cost table, made once (a test plans every arch of its graph)."""
    return analytic_costs(graph, SHAPE, BATCH // M)


def plans(graph: SupernetGraph, arch: Arch, stages: int, planner: str, memory: MemorySettings) -> None:
    """Plan ``arch`` as a pipelined engine's planner does (raises when no split fits the arenas)."""
    sizes = op_footprints(graph, 0, SGD, CPU, memory)
    model = MemoryModel(memory, (memory.device_budget_bytes,) * stages, sizes)
    p = LookaheadPlanner(graph, 0, stages, M, PipelineSettings(planner=planner), _costs(graph), stages > 1, "sgd",
                         model)
    p.ensure(torch.empty((BATCH, *SHAPE)), BATCH // M, training=False)
    p.plan_with(arch, initial_owners(graph.slots(), stages), None)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("planner", ["dynamic", "oracle", "equal", "static"])
def test_pipelined_device_threshold_is_the_least_arena_every_subnet_plans_with(seed: int, stages: int,
                                                                               planner: str) -> None:
    """Every subnet of the space plans at the threshold; at one byte less the largest does not
    (and the dynamic planners' threshold is the brute-force min-max split of the worst subnet)."""
    graph = small_graph(seed)
    memory = MemorySettings(optimizer="device")
    settings = PipelineSettings(planner=planner)
    need = device_need(graph, memory, pipeline=settings, stages=stages)
    at = MemorySettings(device_budget_bytes=need, optimizer="device")
    for arch in every_arch(graph):
        plans(graph, arch, stages, planner, at)
    check_memory(graph, 0, SGD, at, CPU, SHAPE, BATCH, M, no_sampling, 4, pipeline=settings, stages=stages)
    below = MemorySettings(device_budget_bytes=need - 1, optimizer="device")
    sizes = op_footprints(graph, 0, SGD, CPU, memory)
    with pytest.raises(MemoryBudgetError, match=f"raise memory.device_budget_bytes to at least {need}"):
        plans(graph, largest_subnet(graph, sizes), stages, planner, below)
    with pytest.raises(MemoryBudgetError, match=f"raise memory.device_budget_bytes to at least {need}"):
        check_memory(graph, 0, SGD, below, CPU, SHAPE, BATCH, M, no_sampling, 4, pipeline=settings, stages=stages)
    if planner in ("dynamic", "oracle"):
        worst = max(brute_min_max([sizes[op.op_id] for op in graph.active_ops(a)], stages) for a in every_arch(graph))
        assert need == worst


# -- the activation budget -------------------------------------------------------------------

def stream(graph: SupernetGraph, seed: int, n: int) -> list[Arch]:
    gen = torch.Generator().manual_seed(seed)
    archs = every_arch(graph)
    return [archs[int(torch.randint(len(archs), (1,), generator=gen))] for _ in range(n)]


def activation_need(graph: SupernetGraph, archs: list[Arch], start: int = 0, **pipelined) -> int:
    with pytest.raises(ActivationError) as e:
        check_memory(graph, 0, SGD, MemorySettings(activations="auto", activation_budget_bytes=1), CPU, SHAPE, BATCH,
                     M, iter(archs).__next__, len(archs), start, **pipelined)
    need = int(re.search(r"expected at least (\d+) bytes", str(e.value))[1])
    assert f"raise memory.activation_budget_bytes to {need} or more" in str(e.value)
    return need


def engine_plans(graph: SupernetGraph, archs: list[Arch], budget: int) -> bool:
    """Whether the reference engine plans the activations of every one of ``archs`` within ``budget``."""
    eng = ReferenceEngine(graph, 0, SGD, M, LrSchedule(0.05, 4),
                          memory=MemorySettings(activations="auto", activation_budget_bytes=budget))
    try:
        for arch in archs:
            eng._activation_choices(arch, torch.empty((BATCH, *SHAPE)))
        return True
    except ActivationError:
        return False
    finally:
        eng.close()


@pytest.mark.parametrize("seed", range(4))
def test_one_process_activation_threshold_is_the_engines(seed: int) -> None:
    graph = small_graph(seed)
    archs = stream(graph, seed, 6)
    need = activation_need(graph, archs)
    assert engine_plans(graph, archs, need) and not engine_plans(graph, archs, need - 1)
    start = 3  # a resumed run: only the steps from the checkpoint on
    later = activation_need(graph, archs, start)
    assert engine_plans(graph, archs[start:], later) and not engine_plans(graph, archs[start:], later - 1)


def chain_plans(graph: SupernetGraph, archs: list[Arch], stages: int, settings: PipelineSettings,
                budget: int) -> bool:
    """Whether a pipelined engine's planner plans every step of ``archs`` within the activation budget."""
    memory = MemorySettings(activations="auto", activation_budget_bytes=budget)
    p = LookaheadPlanner(graph, 0, stages, M, settings, _costs(graph), stages > 1, "sgd", MemoryModel(memory))
    try:
        p.ensure(torch.empty((BATCH, *SHAPE)), BATCH // M, training=False)
        for _, plan in p.chain(archs, initial_owners(graph.slots(), stages), None):
            for s in range(stages):  # what a training step asks of its plan
                plan.stage_activations(s)
        return True
    except ActivationError:
        return False


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stages, settings", [
    (2, PipelineSettings()), (3, PipelineSettings()), (2, PipelineSettings(schedule="gpipe")),
    (2, PipelineSettings(window=2, planner="dynamic", objective="minmax", eps=0.0)),  # cross-subnet: a bound in flight
])
def test_pipelined_activation_threshold_is_the_planners(seed: int, stages: int, settings: PipelineSettings) -> None:
    graph = small_graph(seed)
    archs = stream(graph, seed, 6)
    need = activation_need(graph, archs, pipeline=settings, stages=stages)
    assert chain_plans(graph, archs, stages, settings, need)
    assert not chain_plans(graph, archs, stages, settings, need - 1)


def test_without_budgets_nothing_is_sampled() -> None:
    graph = small_graph(0)
    for memory in (MemorySettings(), MemorySettings(activations="auto"), MemorySettings(activations="recompute")):
        check_memory(graph, 0, SGD, memory, CPU, SHAPE, BATCH, M, no_sampling, 4)


# -- through the app and the command line -------------------------------------------------------

def app_need(tmp_path: Path, *overrides: str) -> int:
    """The value the app's error names for ``overrides`` (a budget of 1 byte)."""
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg("device=cpu", *overrides), tmp_path / "never")
    assert not (tmp_path / "never").exists()
    return int(re.search(r"(?:expected at least|to at least) (\d+)", str(e.value))[1])


def test_the_app_runs_at_the_device_threshold_and_stops_before_writing_below_it(tmp_path: Path) -> None:
    need = app_need(tmp_path, "memory.device_budget_bytes=1")
    rc = load_config(make_cfg("device=cpu"))
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    assert need == max(TensorManager(graph, rc.seed, rc.train.optimizer).footprint(
        op.op_id for op in graph.active_ops(a)) for a in every_arch(graph))  # hybrid: weights and buffers only
    summary = run(make_cfg("device=cpu", f"memory.device_budget_bytes={need}"), output_dir=tmp_path / "ok")
    assert summary["steps"] == 12 and summary["best"] is not None
    assert 0 < summary["memory"]["resident_bytes_peak"] <= need
    with pytest.raises(ConfigError, match=rf"^memory\.device_budget_bytes: .* to at least {need}$"):
        run(make_cfg("device=cpu", f"memory.device_budget_bytes={need - 1}"), output_dir=tmp_path / "short")
    assert not (tmp_path / "short").exists()


def test_the_app_runs_at_the_activation_threshold_and_stops_before_writing_below_it(tmp_path: Path) -> None:
    auto = "memory.activations=auto"
    need = app_need(tmp_path, auto, "memory.activation_budget_bytes=1")
    rc = load_config(make_cfg("device=cpu"))
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    sampler = _sampler(rc, graph.space())
    trained = [sampler.next() for _ in range(rc.train.steps)]
    x, _ = data.train_batch(0, rc.train.batch_size)
    for budget, fits in ((need, True), (need - 1, False)):  # the engine's own plans agree
        eng = ReferenceEngine(graph, rc.seed, rc.train.optimizer, rc.train.microbatches, LrSchedule(0.05, 4),
                              memory=MemorySettings(activations="auto", activation_budget_bytes=budget))
        try:
            assert all(eng._activation_choices(a, x) is not None for a in trained) == fits
        except ActivationError:
            assert not fits
        eng.close()
    summary = run(make_cfg("device=cpu", auto, f"memory.activation_budget_bytes={need}"), output_dir=tmp_path / "ok")
    assert summary["steps"] == 12 and summary["best"] is not None
    with pytest.raises(ConfigError, match=rf"^memory\.activation_budget_bytes: expected at least {need} bytes .* "
                                          rf"found {need - 1} "):
        run(make_cfg("device=cpu", auto, f"memory.activation_budget_bytes={need - 1}"), output_dir=tmp_path / "short")
    assert not (tmp_path / "short").exists()


def test_a_pipelined_app_checks_its_stages_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (the environment of rank 0 of 2) prepare plans the stages' splits: a device
    budget the largest subnet's best split does not fit fails there, naming the least that fits."""
    one = app_need(tmp_path, "memory.device_budget_bytes=1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    two = app_need(tmp_path, "memory.device_budget_bytes=1", "pipeline.stages=2")
    assert 0 < two < one  # two stages share the largest subnet
    prepare(make_cfg("device=cpu", f"memory.device_budget_bytes={two}", "pipeline.stages=2"), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_the_command_line_exits_2_naming_the_field_and_the_value_and_writes_nothing(tmp_path: Path) -> None:
    device = app_need(tmp_path, "memory.device_budget_bytes=1")
    act = app_need(tmp_path, "memory.activations=auto", "memory.activation_budget_bytes=1")
    base = [*TINY_CONV, *TINY, "device=cpu"]
    cases = {
        "device": ([f"memory.device_budget_bytes={device - 1}"],
                   f"memory.device_budget_bytes to at least {device}"),
        "activations": (["memory.activations=auto", f"memory.activation_budget_bytes={act - 1}"],
                        f"expected at least {act} bytes"),
    }
    results = run_cases([Case([*base, *args, f"hydra.run.dir={tmp_path / name}"], str(tmp_path))
                         for name, (args, _) in cases.items()])
    for (name, (_, expected)), res in zip(cases.items(), results):
        assert res.status == 2, (name, res.stderr[-2000:])
        field = "memory.device_budget_bytes" if name == "device" else "memory.activation_budget_bytes"
        assert len(res.errors) == 1 and res.errors[0].startswith(f"error: {field}: "), res.stderr[-2000:]
        assert expected in res.errors[0] and res.stderr.strip() == res.errors[0], res.stderr[-2000:]
        assert not (tmp_path / name).exists()
