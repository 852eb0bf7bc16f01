"""Feasibility: the memory budgets a run would reject, found before it starts (no engine, no process group).

:func:`check_memory` raises, with the field to raise and the least value that fits, where the
engine would later stop on ``memory.device_budget_bytes`` or ``memory.activation_budget_bytes``.
It asks the code the engines ask, on the same numbers: the arena bytes of each op
(:func:`~pipeline.memory.sizing.op_footprints`, what the tensor manager counts), the planner's
splits (:class:`~pipeline.lookahead.LookaheadPlanner`, pure) and the activation floors
(:meth:`~pipeline.memory.sizing.MemoryModel.activation_floors`, below which
:meth:`~pipeline.memory.sizing.MemoryModel.activation_choices` raises).

Device budget. The search may train or score any subnet, so the largest one must fit. Every
subnet runs exactly one op per node of the supernet graph, in the same (topological) node order
(:meth:`supernet.SupernetGraph.active_ops`; a ``zero`` or ``identity`` candidate is still that
node's op, of few or no bytes, and no choice switches other nodes off), and the search space is
the product of the slots' candidates. So the subnet that takes every slot's candidate of most
arena bytes (:func:`~pipeline.memory.sizing.largest_subnet`) is a subnet of the space, and every
other subnet's sequence of op footprints is, position by position, no larger than its. What the
engine checks is monotone in those footprints: one process, their sum (the reference engine's
check at start-up); P stages, a stage's memory is the sum of its ops' arena bytes (the
partitioner's model with an arena, no reserve), and the smallest over contiguous splits (empty
stages allowed) of the largest stage (the dynamic and oracle planners: they find a split when
one fits) or the largest stage of a split fixed by the op count or the supernet's mean costs
(equal, static): lowering any footprint lowers no stage's sum. Hence the largest subnet is the
worst case, and the number reported (the budget it needs, from the planner's own error) is the
least budget with which every subnet can be planned.

Activation budget (``memory.activations=auto``). Only training keeps activations, and the
subnets trained are the sampler's stream, known in advance: for each step from where the run
starts, the floor of each stage under the split the engine takes (one process: one stage of all
the subnet's ops; P stages: the lookahead planner's split, chained through the placement each
plan leaves, from the initial owners, as the engine trains them). The value that fits is the
largest floor. Floors are memoised per (subnet, split).

What still fails only at run time: ``memory.device_budget_fraction`` (a fraction of the CUDA
device's free memory when the manager starts), and with it a pipelined run's activation check
(its splits depend on the arenas). A subnet the search only scores needs no activation plan (an
evaluation keeps no activations: :meth:`~pipeline.lookahead.Plan.stage_activations` raises only
when a plan is trained).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from supernet import Arch, SupernetGraph

from .memory import MemoryModel, MemorySettings, OptimConfig
from .memory.errors import activation_budget_error
from .memory.sizing import check_largest_subnet, largest_subnet, op_footprints
from .plan.costs import CostTable, analytic_costs
from .plan.placement import initial_owners
from .plan.schedule import one_f_one_b
from .reference import activation_problem
from .settings import PipelineSettings

__all__ = ["check_memory"]


def check_memory(graph: SupernetGraph, seed: int, optim: OptimConfig, memory: MemorySettings, device: torch.device,
                 sample_shape: Sequence[int], batch_size: int, microbatches: int, sample: Callable[[], Arch],
                 steps: int, start: int = 0, pipeline: PipelineSettings | None = None, stages: int = 1,
                 replicas: int = 1) -> None:
    """Raise where the engine would stop on a memory budget: a
    :class:`~pipeline.memory.MemoryBudgetError` naming ``memory.device_budget_bytes``, or an
    :class:`~pipeline.plan.activations.ActivationError` naming ``memory.activation_budget_bytes``,
    each with the least value that fits.

    ``device``: the engine's device (its alignment); ``sample``: the sampler's ``next``, the
    arch of each training step in turn from step 0; the run trains steps ``start`` to ``steps``.
    ``pipeline``: the pipelined engine's settings and its layout (``stages`` x ``replicas``
    processes); None: one process (the reference engine)."""
    auto = memory.activations == "auto" and memory.activation_budget_bytes is not None
    if memory.device_budget_bytes is None and not auto:
        return
    sizes = op_footprints(graph, seed, optim, device, memory) if memory.device_budget_bytes is not None else None
    trained = itertools.islice(iter(sample, None), start, steps)
    # the cost table the engines plan with, from the first training batch's shape
    costs = lambda: analytic_costs(graph, tuple(sample_shape), batch_size // microbatches, optim.name)  # noqa: E731
    if pipeline is None:
        if sizes is not None:
            check_largest_subnet(graph, sizes, memory.device_budget_bytes)
        if auto:
            _check_one_process(graph, costs(), microbatches, memory, trained)
        return
    if memory.device_budget_fraction is not None:
        return  # the arenas, and so the splits, are known when each stage's manager starts
    _check_pipelined(graph, seed, costs(), optim.name, batch_size, sample_shape, microbatches, memory, sizes,
                     trained if auto else None, pipeline, stages, replicas)


def _check_one_process(graph: SupernetGraph, costs: CostTable, microbatches: int, memory: MemorySettings,
                       trained) -> None:
    """The reference engine's activation plans: one stage, one micro-batch in flight."""
    model, schedule = MemoryModel(memory), one_f_one_b(1, microbatches)
    floors: dict[Arch, int] = {}
    for arch in trained:
        if arch not in floors:
            problem = activation_problem(graph, arch, costs, microbatches, schedule)
            floors[arch] = model.activation_floors(problem, (0, problem.num_ops))[0]
    _raise_over(memory.activation_budget_bytes, ((f, a, 0, None) for a, f in floors.items()), len(floors),
                ["make micro-batches smaller (a smaller train.batch_size or more train.microbatches)"])


def _check_pipelined(graph: SupernetGraph, seed: int, costs: CostTable, optim_name: str, batch_size: int,
                     sample_shape: Sequence[int], microbatches: int, memory: MemorySettings,
                     sizes: dict[str, int] | None, trained, settings: PipelineSettings, stages: int,
                     replicas: int) -> None:
    """The lookahead planner of every stage (each plans alike): the largest subnet's split must fit
    the arenas, and the splits of the trained subnets their activation budget."""
    from .lookahead import LookaheadPlanner  # the runtime's planner; imported here, where it plans

    # Activations are planned apart (floors below): a split does not depend on memory.activations
    plain = dataclasses.replace(memory, activations="keep")
    model = (MemoryModel(plain) if sizes is None else
             MemoryModel(plain, (memory.device_budget_bytes,) * stages, sizes))
    # as PipelineEngine builds its planner: the replica's micro-batches, and moves made ahead
    # wherever there is a second stage to move to
    planner = LookaheadPlanner(graph, seed, stages, microbatches // replicas, settings, costs, stages > 1,
                               optim_name, model)
    planner.ensure(torch.empty((batch_size, *sample_shape), device="meta"), batch_size // microbatches,
                   training=False)
    if sizes is not None:  # raises the planner's own error, with the least budget that fits
        planner.plan_with(largest_subnet(graph, sizes), initial_owners(graph.slots(), stages), None)
    if trained is None:
        return
    floors: dict[tuple, tuple[int, ...]] = {}
    for _, plan in planner.chain(list(trained), initial_owners(graph.slots(), stages), None):
        key = (plan.arch, plan.partition.bounds)
        if key not in floors:
            floors[key] = model.activation_floors(planner.problem(plan.arch), plan.partition.bounds)
    hints = ["a smaller train.batch_size"]
    if settings.schedule == "gpipe":
        hints.append("pipeline.schedule=1f1b (fewer micro-batches in flight)")
    _raise_over(memory.activation_budget_bytes,
                ((f, arch, s, bounds) for (arch, bounds), fs in floors.items() for s, f in enumerate(fs)),
                len({arch for arch, _ in floors}), hints)


def _raise_over(budget: int, floors, subnets: int, hints: Sequence[str]) -> None:
    """Raise the activation budget's error when the largest of ``floors`` ((bytes, arch, stage,
    bounds or None) each) is over ``budget``."""
    worst = max(floors, key=lambda f: f[0], default=None)
    if worst is None or worst[0] <= budget:
        return
    need, arch, stage, bounds = worst
    where = "" if bounds is None else f" on stage {stage} of the split {tuple(bounds)}"
    raise activation_budget_error(f"the activations of subnet {arch.to_json()}{where} (the most among the {subnets} "
                                  f"subnets this run trains)", need, budget, hints)
