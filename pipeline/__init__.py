"""The pipeline engine: schedules, partitions, transport, migration and the stage runtime.

``create_engine`` is the entry point: the single-process reference engine outside torchrun,
the pipelined engine (one process per stage) under it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from supernet import SupernetGraph

from .engine import Engine, EvalResult, LrSchedule, StepResult
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
                  trace_steps: Iterable[int] = ()) -> Engine:
    """The engine for this process: the reference outside torchrun (``env`` is ``None`` and no
    RANK/WORLD_SIZE is set), else one pipeline stage per rank. ``failure_dir`` (the run
    directory's ``failures/``) is where a failing rank leaves the note its peers quote.
    ``memory``: the tensor manager's device budget (per process: per stage under torchrun).
    ``trace_steps``: the steps whose spans are recorded (``engine.trace_spans()`` gathers them)."""
    env = env if env is not None else dist_env()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if env is None:
        return ReferenceEngine(graph, seed, optim, microbatches, lr, dev, memory=memory, trace_steps=trace_steps)
    from .runtime import PipelineEngine

    return PipelineEngine(graph, seed, optim, microbatches, lr, settings, env, dev, failure_dir=failure_dir,
                          trace_steps=trace_steps, memory=memory)
