"""A run's layout: how many pipeline stages S and replicas R its N processes form. One function, called before anything is written (the app's
``prepare``, on every rank alike) and again by the pipelined engine, so a layout the command
line accepts is the one the engine runs.

* One process (N = 1): ``pipeline.stages`` null, 1 or ``auto``; more stages need torchrun.
* N processes: ``null`` is one stage per process (S = N, R = 1); a divisor S of N runs R = N / S
  replicas of an S-stage pipeline (:mod:`pipeline.replicas`), which needs ``train.microbatches``
  to be a multiple of R; ``auto`` is the mesh planner's pick (:mod:`pipeline.plan.mesh`) among
  the layouts this run's settings allow, and one stage per process when the run bounds memory
  (:func:`memory_bound`: stages split a subnet's memory, replicas copy it).
* Replicated stages combine with every other setting (what does not combine is the one table
  of :mod:`pipeline.combinations`).

Under torchrun the engine calls :func:`choose_layout` once the process group is up: with
``stages: auto`` or ``window: auto`` it measures this machine (the op profile,
:func:`pipeline.profile.shared_profile`; the runtime's costs, :func:`pipeline.calibrate.runtime_costs`;
the planning of a subnet per stage count) and picks the (S, R, W) the simulator predicts fastest
(:func:`pipeline.plan.mesh.layout_options`), every rank alike; the choice and every
alternative's predicted samples/s are logged and go to the summary (``layout``). ``prepare``
(before any process group) checks the config with the analytic pick of :func:`resolve_layout`;
when the run bounds memory both take one stage per process and only the window is chosen.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supernet import SupernetGraph

from .memory import MemorySettings
from .settings import PipelineSettings

if TYPE_CHECKING:
    import torch

    from .memory import OptimConfig
    from .plan.costs import CostTable
    from .plan.mesh import LayoutOption
    from .plan.overhead import RuntimeCosts

__all__ = ["Layout", "LayoutError", "choose_layout", "memory_bound", "price_layouts",
           "resolve_layout", "replicas_of"]

log = logging.getLogger(__name__)


class LayoutError(ValueError):
    """The world size, ``pipeline.stages`` and the other settings do not form a layout."""


@dataclass(frozen=True)
class Layout:
    stages: int
    replicas: int
    predicted_samples_per_s: float | None = None  # auto: the mesh planner's figure for its pick
    window: int | None = None  # choose_layout: the window run (None: pipeline.window as set)
    options: tuple = ()  # choose_layout: every alternative priced (pipeline.plan.mesh.LayoutOption)
    costs: str | None = None  # choose_layout: what it priced them with

    def to_json(self) -> dict:
        """What the summary records: the layout run and, when chosen, every alternative's prediction."""
        return {"stages": self.stages, "replicas": self.replicas, "window": self.window,
                "predicted_samples_per_s": (round(self.predicted_samples_per_s, 1)
                                            if self.predicted_samples_per_s is not None else None),
                "costs": self.costs, "options": [o.to_json() for o in self.options]}


def resolve_layout(settings: PipelineSettings, memory: MemorySettings | None, world_size: int, microbatches: int,
                   graph: SupernetGraph | None = None, optimizer: str = "sgd",
                   sample_shape: Sequence[int] | None = None, batch_size: int | None = None) -> Layout:
    """The (S, R) this run takes, or :class:`LayoutError` naming the field. ``graph``,
    ``optimizer``, ``sample_shape`` and ``batch_size``: what ``stages: auto`` plans with."""
    stages = settings.stages
    if world_size == 1:
        if stages not in (None, 1, "auto"):
            raise LayoutError(f"pipeline.stages: expected the number of processes (one stage each) or null, found "
                              f"{stages}: this run is one process; run it with torchrun --nproc_per_node={stages} "
                              "-m search")
        return Layout(1, 1)
    if stages == "auto":
        if memory_bound(settings, memory):  # pipelining is what splits a subnet's memory
            return Layout(world_size, replicas_of(world_size, world_size, microbatches))
        return _auto(graph, world_size, microbatches, settings, optimizer, sample_shape, batch_size)
    stages = world_size if stages is None else stages
    replicas = replicas_of(world_size, stages, microbatches)
    return Layout(stages, replicas)


def memory_bound(settings: PipelineSettings, memory: MemorySettings | None) -> bool:
    """Whether the run bounds or moves memory (a device budget, ``pipeline.memory_budget_bytes``,
    activations other than kept or an activation budget): then ``stages: auto`` is one stage per
    process, as the budgets were meant for (stages split a subnet's memory; replicas copy it)."""
    return settings.memory_budget_bytes is not None or (memory is not None and (
        memory.virtual or memory.activations != "keep" or memory.activation_budget_bytes is not None))


def replicas_of(world_size: int, stages: int, microbatches: int) -> int:
    """R = N / S, or :class:`LayoutError` when S does not divide N or R does not divide M."""
    if stages < 1 or world_size % stages:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise LayoutError(f"pipeline.stages: expected a divisor of the number of processes {world_size} "
                          f"(processes = stages x replicas: one of {divisors}), 'auto' or null, found {stages}")
    replicas = world_size // stages
    if microbatches % replicas:
        raise LayoutError(f"train.microbatches: expected a multiple of the replica count {replicas} "
                          f"({world_size} processes / pipeline.stages {stages}), found {microbatches}")
    return replicas


def _auto(graph: SupernetGraph | None, world_size: int, microbatches: int, settings: PipelineSettings,
          optimizer: str, sample_shape: Sequence[int] | None, batch_size: int | None) -> Layout:
    """The mesh planner's pick from an analytic cost table of the supernet's average subnet
    (the same on every rank)."""
    from .plan.costs import analytic_costs, mean_problem
    from .plan.mesh import mesh_options, recommend

    if graph is None or sample_shape is None or batch_size is None:
        raise LayoutError("pipeline.stages: 'auto' needs the supernet, the sample shape and the batch size; "
                          "give a number of stages instead")
    mb = batch_size // microbatches
    table = analytic_costs(graph, tuple(sample_shape), mb, optimizer)
    mean = mean_problem(graph, table, num_stages=1, num_microbatches=microbatches)
    options = mesh_options(mean, world_size, microbatches, mb, settings.link_bandwidth, settings.link_latency_s)
    if not options:
        raise LayoutError(f"pipeline.stages: 'auto' found no (stages, replicas) for {world_size} processes with "
                          f"train.microbatches={microbatches}")
    best = recommend(options)
    return Layout(best.stages, best.replicas, best.samples_per_s)


WINDOWS = (1, 2, 4, 8)  # pipeline.window=auto: the windows priced (with delayed or frozen shared ops)
SUBNETS = 16  # the subnets each layout is simulated over (uniformly sampled, seeded)


def price_layouts(graph: SupernetGraph, table: CostTable, runtime: RuntimeCosts, world_size: int,
                  microbatches: int, batch_size: int, settings: PipelineSettings, seed: int = 0,
                  plan_s: dict[int, float] | None = None, cpus: int | None = None) -> list[LayoutOption]:
    """Every (S, R, W) this run may take, priced (pure: :func:`pipeline.plan.mesh.layout_options`
    over :data:`SUBNETS` subnets drawn from the space with ``seed``, each partitioned over S
    stages with ``table`` (its ops) and ``runtime`` (:class:`~pipeline.plan.overhead.RuntimeCosts`)).
    ``plan_s``: per S, the CPU seconds of planning one flushed subnet (its wire specs' dry run),
    charged to every stage when the machine has no core to spare for the planning thread
    (``cpus`` <= ``world_size``). The subnets are drawn uniformly: a fair sampler's conflict less,
    so a window's gain is if anything underestimated. With ``pipeline.inflight=bytes`` the
    cross-subnet schedules are priced with the in-flight cap in bytes, as the runtime runs them."""
    import random

    from .plan.costs import subnet_problem
    from .plan.mesh import layout_options, meshes
    from .plan.overhead import subnet_work
    from .plan.partition import kept_per_microbatch, solve
    from .shared import read_late, shared_ops_of, stateful_ops
    from supernet.execute import cut

    space = graph.space()
    rng = random.Random(f"{seed}/layout")
    archs = [space.random(rng) for _ in range(SUBNETS)]
    stateful = stateful_ops(graph)
    shared = shared_ops_of(graph)
    pinned_w = settings.window if isinstance(settings.window, int) else None
    windows = (pinned_w,) if pinned_w is not None else (WINDOWS if settings.shared_ops != "exact" else (1,))
    pinned_s = settings.stages if isinstance(settings.stages, int) else (world_size if settings.stages is None else None)
    spare = cpus is not None and cpus > world_size
    works, kept = {}, {}
    by_bytes = settings.inflight == "bytes"  # the byte cap prices with each subnet's kept bytes
    for s, r in meshes(world_size, microbatches, min(world_size, len(graph.active_ops(archs[0])))):
        if pinned_s is not None and s != pinned_s:
            continue
        # cross-subnet segments send self-describing messages and plan no wire specs
        cross = settings.shared_ops != "exact" or any(w > 1 for w in windows)
        extra = 0.0 if spare or cross else (plan_s or {}).get(s, 0.0)
        row, kept_row = [], []
        for arch in archs:
            active = graph.active_ops(arch)
            problem = subnet_problem(graph, active, table, s, microbatches // r, settings.schedule, runtime.bandwidth,
                                     runtime.latency_s)
            bounds = solve(problem).bounds if s > 1 else (0, len(active))
            uses = [frozenset(op.op_id for op in sl.ops) & stateful for sl in cut(active, bounds, graph.output)]
            row.append(subnet_work(problem, bounds, uses, runtime, r, settings.reduce, extra_s=extra,
                                   self_describing=cross))
            if by_bytes:
                kept_row.append(kept_per_microbatch(problem, bounds))
        works[(s, r)] = row
        if by_bytes:
            kept[(s, r)] = kept_row
    frozen = shared if settings.shared_ops == "frozen" else frozenset()
    delayed, delays = read_late(settings.shared_ops, shared, settings.shared_delay, settings.shared_delays)
    options = layout_options(works, microbatches, batch_size, windows, settings.schedule, frozen=frozen,
                             delayed=delayed, delay=settings.shared_delay if delayed else 0, delays=delays,
                             kept=kept if by_bytes else None)
    # the few subnets simulated stand for the space: their mean compute against that of many
    # more (a sum per subnet, no schedule) corrects the sample's luck in every option alike
    factor = _sample_factor(graph, table, archs, random.Random(f"{seed}/layout-population"))
    return [dataclasses.replace(o, step_s=o.step_s * factor, samples_per_s=o.samples_per_s / factor)
            for o in options]


POPULATION = 512  # subnets whose compute the simulated ones' is scaled to (price_layouts)


def _sample_factor(graph: SupernetGraph, table: CostTable, archs: Sequence, rng) -> float:
    """Mean compute (forward and backward, the table's) of :data:`POPULATION` subnets drawn with
    ``rng`` over that of ``archs``: a ratio estimator of the space's mean step from the sample's
    (the 16 subnets of one seed priced the transformer w256's data-parallel step 9 % low,
    36.9 ms against 40.7 ms over 512 subnets, the run's own 41.3 ms)."""
    space = graph.space()

    def compute(arch) -> float:
        return sum(table.ops[op.op_id].fwd + table.ops[op.op_id].bwd for op in graph.active_ops(arch))

    sample = sum(compute(a) for a in archs) / len(archs)
    population = sum(compute(space.random(rng)) for _ in range(POPULATION)) / POPULATION
    return population / sample if sample > 0 else 1.0


def _planning_seconds(graph: SupernetGraph, stages: Sequence[int], sample_shape: Sequence[int], microbatch: int,
                      seed: int, repeats: int = 3) -> dict[int, float]:
    """Per stage count S > 1: the median seconds of planning one subnet as the runtime does
    a segment ahead (the partition and the wire specs' dry run on the meta device)."""
    import random
    import statistics
    import time

    import torch

    from .plan.partition import PartitionProblem, solve
    from .wire import MetaModules, wire_specs
    from supernet import build_op
    from supernet.execute import cut

    space = graph.space()
    rng = random.Random(f"{seed}/layout-planning")
    specs = {slot.op_id: slot.spec for slot in graph.slots()}
    meta = MetaModules(lambda op_id: build_op(specs[op_id], op_id, seed, seeded=False))
    for op_id in specs:  # built once per run (the runtime's planner keeps them): not timed
        meta(op_id)
    out = {}
    for s in stages:
        if s <= 1:
            continue
        times = []
        for i in range(repeats + 1):  # the first warms the dispatcher's caches: not timed
            active = graph.active_ops(space.random(rng))
            t0 = time.perf_counter()
            n = len(active)
            bounds = solve(PartitionProblem(ops=tuple(_unit(op.op_id) for op in active), cut_bytes=(0,) * (n + 1),
                                            num_stages=min(s, n), num_microbatches=1)).bounds
            wire_specs(cut(active, bounds, graph.output), meta, (microbatch, *sample_shape), torch.float32, seed)
            if i:
                times.append(time.perf_counter() - t0)
        out[s] = statistics.median(times)
    return out


def _unit(op_id: str):
    from .plan.partition import OpCost

    return OpCost(op_id, 1.0, 2.0, 0, 0, 0)  # planning time does not depend on the costs: unit ones


def choose_layout(settings: PipelineSettings, memory: MemorySettings | None, rank: int, world_size: int,
                  microbatches: int, graph: SupernetGraph, optim: OptimConfig, sample_shape: Sequence[int] | None,
                  batch_size: int | None, device: torch.device | str, seed: int = 0,
                  costs: CostTable | None = None) -> tuple[Layout, CostTable | None, RuntimeCosts | None]:
    """The layout this run takes, and the cost table and runtime costs it was chosen with (None,
    None when nothing was measured). Collective under ``auto`` (every rank of the default group
    calls it alike, after ``init_process_group``); otherwise :func:`resolve_layout`.
    ``costs``: a cost table to price ops with (None: the measured profile)."""
    auto = settings.stages == "auto" or settings.window == "auto"
    if world_size == 1 or not auto:
        layout = resolve_layout(settings, memory, world_size, microbatches, graph, optim.name, sample_shape, batch_size)
        return (layout if settings.window != "auto" else Layout(layout.stages, layout.replicas,
                                                                layout.predicted_samples_per_s, 1)), None, None
    if sample_shape is None or batch_size is None:
        raise LayoutError("pipeline.stages / pipeline.window: 'auto' needs the sample shape and the batch size; "
                          "give a number of stages and a window instead")
    import os

    import torch
    import torch.distributed as dist

    from .calibrate import runtime_costs
    from .plan.mesh import meshes, pick
    from .profile import shared_profile

    if settings.stages == "auto" and memory_bound(settings, memory):  # (resolve_layout)
        settings = dataclasses.replace(settings, stages=world_size)
    mb = batch_size // microbatches
    table = costs if costs is not None else shared_profile(graph, sample_shape, mb, optim.name, rank, world_size,
                                                           device)
    runtime = runtime_costs(graph, sample_shape, optim, rank, world_size, device)
    device = torch.device(device)
    box: list = [{}]
    cross = settings.shared_ops != "exact" or (isinstance(settings.window, int) and settings.window > 1)
    if rank == 0 and not cross and (os.cpu_count() or 1) <= world_size:  # what price_layouts charges
        box[0] = _planning_seconds(graph, [s for s, _ in meshes(world_size, microbatches, world_size)
                                           if settings.stages in ("auto", None, s)], sample_shape, mb, seed)
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    options = price_layouts(graph, table, runtime, world_size, microbatches, batch_size, settings, seed, box[0],
                            os.cpu_count())
    if not options:
        raise LayoutError(f"pipeline.stages: 'auto' found no (stages, replicas) for {world_size} processes with "
                          f"train.microbatches={microbatches}")
    best = pick(options)
    where = f"{table.source} ops, {runtime.source} runtime costs"
    if rank == 0:
        log.info("pipeline layout: %d stages x %d replicas, window %d, predicted %.0f samples/s (%s); alternatives: %s",
                 best.stages, best.replicas, best.window, best.samples_per_s, where,
                 "; ".join(f"{o.stages}x{o.replicas} w{o.window}: {o.samples_per_s:.0f} samples/s "
                           f"({1e3 * o.step_s:.1f} ms/step)" for o in options))
    return Layout(best.stages, best.replicas, best.samples_per_s, best.window, tuple(options), where), table, runtime
