"""On CUDA a pipelined step reads nothing back to the host between its first and last action.

Runs only where CUDA is available (skipped in CI): one stage on one GPU (a world of one over
NCCL), the stage executor's whole action list under ``torch.cuda.set_sync_debug_mode("error")``,
which raises on any synchronising call (``.item()``, ``.tolist()``, ``bool(tensor)``, a
blocking device-to-host copy), except the subnet's update, which reads its losses once (after
its last forward and backward) to decide whether to step.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("space", ["transformer", "conv", "cell"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_step_has_no_host_sync_inside(space: str, schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from distributed import build_graph
    from pipeline import DistEnv, LrSchedule, OptimConfig, PipelineSettings
    from pipeline.runtime import PipelineEngine

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + random.Random(os.getpid()).randrange(500)))
    graph = build_graph(space)
    optim = OptimConfig(name="adamw", lr=1e-3)
    engine = PipelineEngine(graph, 0, optim, 4, LrSchedule(1e-3, 10), PipelineSettings(schedule=schedule, backend="nccl"),
                            DistEnv(0, 1, 0), torch.device("cuda"))
    inner, inner_update = engine.executor.run, engine.executor._update
    guarded_runs = []

    def update(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return inner_update(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def guarded(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        guarded_runs.append(1)
        return out

    monkeypatch.setattr(engine.executor, "run", guarded)
    monkeypatch.setattr(engine.executor, "_update", update)
    try:
        rng = random.Random(0)
        for step in range(3):
            x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
            r = engine.train_step(step, graph.space().random(rng), x, y)
            assert len(r.microbatch_losses) == 4 and all(v == v for v in r.microbatch_losses)
        assert len(guarded_runs) == 3
    finally:
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
