"""A run's layout: how many pipeline stages S and replicas R its N processes form. One function, called before anything is written (the app's
``prepare``, on every rank alike) and again by the pipelined engine, so a layout the command
line accepts is the one the engine runs.

* One process (N = 1): ``pipeline.stages`` null, 1 or ``auto``; more stages need torchrun.
* N processes: ``null`` is one stage per process (S = N, R = 1); a divisor S of N runs R = N / S
  replicas of an S-stage pipeline (:mod:`pipeline.replicas`), which needs ``train.microbatches``
  to be a multiple of R; ``auto`` is the mesh planner's pick (:mod:`pipeline.plan.mesh`) among
  the layouts this run's settings allow.
* Replicated stages combine with every other setting (what does not combine is the one table
  of :mod:`pipeline.combinations`).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from supernet import SupernetGraph

from .memory import MemorySettings
from .settings import PipelineSettings

__all__ = ["Layout", "LayoutError", "resolve_layout", "replicas_of"]

log = logging.getLogger(__name__)


class LayoutError(ValueError):
    """The world size, ``pipeline.stages`` and the other settings do not form a layout."""


@dataclass(frozen=True)
class Layout:
    stages: int
    replicas: int
    predicted_samples_per_s: float | None = None  # auto: the mesh planner's figure for its pick


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
        return _auto(graph, world_size, microbatches, settings, optimizer, sample_shape, batch_size)
    stages = world_size if stages is None else stages
    replicas = replicas_of(world_size, stages, microbatches)
    return Layout(stages, replicas)


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
