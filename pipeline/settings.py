"""Pipeline settings (the ``pipeline`` config group) and the torchrun environment."""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["PipelineSettings", "DistEnv", "dist_env"]

SCHEDULES = ("gpipe", "1f1b")
PLANNERS = ("dynamic", "equal", "static", "oracle")


@dataclass(frozen=True)
class PipelineSettings:
    """How a run is pipelined.

    ``stages``: pipeline depth; ``None`` means the world size (one stage per process).
    ``schedule``: ``gpipe`` or ``1f1b``. ``planner``: how each subnet is partitioned.
    ``eps``: the migration-aware planner's slack over the optimal slowest-stage time.
    ``timeout_s``: every wait on another rank gives up after this long, and the job exits.
    ``backend``: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
    """

    stages: int | None = None
    schedule: str = "1f1b"
    planner: str = "dynamic"
    eps: float = 0.05
    timeout_s: float = 60.0
    backend: str = "auto"
    check_agreement: bool = True

    def __post_init__(self) -> None:
        if self.stages is not None and (not isinstance(self.stages, int) or self.stages < 1):
            raise ValueError(f"pipeline.stages: expected a positive integer or null, found {self.stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule: expected one of {list(SCHEDULES)}, found {self.schedule!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"pipeline.planner: expected one of {list(PLANNERS)}, found {self.planner!r}")
        if not self.eps >= 0:
            raise ValueError(f"pipeline.eps: expected a number >= 0, found {self.eps!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"pipeline.timeout_s: expected a positive number of seconds, found {self.timeout_s!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"pipeline.backend: expected 'auto', 'gloo' or 'nccl', found {self.backend!r}")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def dist_env() -> DistEnv | None:
    """The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK), or ``None`` outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
