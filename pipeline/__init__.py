"""The pipeline engine: schedules, partitions, transport, migration and the stage runtime.

``create_engine`` is the entry point: the single-process reference engine outside torchrun,
the pipelined engine under it (one process per stage, or R replicas of an S-stage pipeline).
"""
from __future__ import annotations

from collections.abc import Iterable


from supernet import SupernetGraph

from .combinations import check as check_combination
from .engine import Engine, EvalResult, LrSchedule, StepResult, engine_device
from .memory import MemoryBudgetError, MemorySettings, MemoryStats, OptimConfig, TensorManager, params_digest
from .reference import ReferenceEngine
from .settings import DistEnv, PipelineSettings, dist_env

__all__ = [
    "DistEnv", "Engine", "EvalResult", "LrSchedule", "MemoryBudgetError", "MemorySettings", "MemoryStats",
    "OptimConfig", "PipelineSettings", "ReferenceEngine",
    "StepResult", "TensorManager", "create_engine", "dist_env", "params_digest",
]


def create_engine(graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int, lr: LrSchedule,
                  settings: PipelineSettings, device: str = "auto", env: DistEnv | None = None,
                  failure_dir: str | None = None, memory: MemorySettings | None = None,
                  trace_steps: Iterable[int] = (), checkpoint_every: int = 0,
                  sample_shape: tuple[int, ...] | None = None, batch_size: int | None = None,
                  clip_grad_norm: float | None = None) -> Engine:
    """The engine for this process: the reference outside torchrun (``env`` is ``None`` and no
    RANK/WORLD_SIZE is set), else one pipeline stage per rank. ``failure_dir`` (the run
    directory's ``failures/``) is where a failing rank leaves the note its peers quote.
    ``memory``: the tensor manager's device budget (per process: per stage under torchrun).
    ``trace_steps``: the steps whose spans are recorded (``engine.trace_spans()`` gathers them).
    ``sample_shape`` and ``batch_size``: what ``pipeline.stages: auto`` plans the mesh for.
    ``clip_grad_norm``: clip each subnet's gradients to this global L2 norm (None: off;
    :class:`pipeline.engine.GradClip`; every layout and schedule).
    ``checkpoint_every``: where the run's checkpoint boundaries fall (delayed shared ops read no
    version from before the last one, so a resumed run computes what an uninterrupted one does)."""
    env = env if env is not None else dist_env()
    dev = engine_device(device)
    check_combination(settings, memory, clip_grad_norm, env.world_size if env is not None else 1)
    compensation = (settings.delay_compensation, settings.delay_compensation_coef)
    if env is None:
        return ReferenceEngine(graph, seed, optim, microbatches, lr, dev, memory=memory, trace_steps=trace_steps,
                               shared_ops=settings.shared_ops, shared_delay=settings.shared_delay,
                               checkpoint_every=checkpoint_every, clip_grad_norm=clip_grad_norm,
                               delay_compensation=compensation, shared_delays=settings.shared_delays)
    from .runtime import PipelineEngine

    return PipelineEngine(graph, seed, optim, microbatches, lr, settings, env, dev, failure_dir=failure_dir,
                          trace_steps=trace_steps, memory=memory, checkpoint_every=checkpoint_every,
                          sample_shape=sample_shape, batch_size=batch_size, clip_grad_norm=clip_grad_norm)
