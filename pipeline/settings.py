"""Pipeline settings (the ``pipeline`` config group) and the torchrun environment."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["COMPENSATIONS", "PipelineSettings", "DistEnv", "check_compensation", "check_delays", "dist_env"]

SCHEDULES = ("gpipe", "1f1b", "zbh1")
PLANNERS = ("dynamic", "equal", "static", "oracle")
SHARED_MODES = ("exact", "delayed", "frozen")  # pipeline.shared_ops (pipeline/shared.py)
# pipeline.delay_compensation: what a delayed shared op does about its staleness (pipeline/shared.py)
COMPENSATIONS = ("none", "predict", "dc", "step")


@dataclass(frozen=True)
class PipelineSettings:
    """How a run is pipelined.

    ``stages``: pipeline depth S; ``None`` means the world size (one stage per process); a
    divisor S of the world size N runs N / S replicas of an S-stage pipeline (a 2-D mesh,
    :mod:`pipeline.replicas`); ``auto``: the mesh planner's pick (:mod:`pipeline.plan.mesh`).
    ``schedule``: ``gpipe``, ``1f1b`` or ``zbh1`` (1F1B with each backward split into its input
    gradient B and its weight gradient W, W filling the drain's bubbles: zero-bubble's ZB-H1,
    :func:`pipeline.plan.schedule.zb_h1`). ``planner``: how each subnet is partitioned.
    ``eps``: the migration-aware planner's slack over the optimal slowest-stage time.
    ``objective``: the dynamic planner's choice: ``step`` weighs migration time against the
    step time a better balance saves; ``minmax`` takes the fewest moved bytes within ``eps``.
    ``migration_overhead_s``: what moving one op costs beyond its bytes on the link (messages,
    rebuilding the op and its optimizer); ``step`` charges it per moved op. Measured on a
    2-process CPU/gloo run at a few ms (bench/dynamic_vs_static_cpu.py); far less on GPUs.
    ``timeout_s``: every wait on another rank gives up after this long, and the job exits.
    ``backend``: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
    ``link_bandwidth`` (bytes/s) and ``link_latency_s``: the link model the planner charges for
    what crosses a cut. ``memory_budget_bytes``: per-stage limit on weights, optimizer state and
    in-flight activations (``null``: no limit). ``trace_steps``: training steps whose timeline
    every rank records (:mod:`pipeline.trace`); rank 0 writes them to ``trace.json``.
    ``reduce``: how replicated stages sum gradients: ``exact`` (the default, bit-identical to one
    process: a fold in micro-batch order along the replicas) or ``fast`` (one all-reduce, not
    bit-identical; :mod:`pipeline.replicas`).
    ``window``: subnets in flight at once; ``auto``: under torchrun the layout chooser's pick
    (:func:`pipeline.layout.choose_layout`; 1 with exact shared ops, and in one process).
    ``delay_compensation`` (delayed shared ops only; ignored otherwise): ``none``, ``predict``
    (the version read is extrapolated along its last update, ``delay_compensation_coef`` x the
    updates it misses), ``dc`` (DC-ASGD: the gradient plus coef x g*g*(live - read) as it reaches
    the live op) or ``step`` (a delayed op's update scaled by coef, in (0, 1]);
    :class:`pipeline.shared.SharedOps` runs it, in the reference and the pipeline alike.
    ``shared_delays`` (delayed shared ops only): op id -> that op's own delay instead of
    ``shared_delay`` (0: read exactly); which ops exist is checked against the space.
    ``inflight`` (cross-subnet schedules only): how a stage's cap on the micro-batches it holds
    between forward and backward is counted: ``count`` (1F1B's ``P - s``; ``P`` with the B/W
    split) or ``bytes`` (the activation bytes that count needs for the subnet that keeps the most
    there, from the cost table: the same peak, more micro-batches of the lighter subnets;
    :class:`pipeline.plan.admission.ActivationCap`).
    """

    stages: int | str | None = None
    schedule: str = "1f1b"
    planner: str = "dynamic"
    eps: float = 0.05
    objective: str = "step"
    migration_overhead_s: float = 2e-3
    timeout_s: float = 60.0
    backend: str = "auto"
    check_agreement: bool = True
    link_bandwidth: float = 1e9
    link_latency_s: float = 5e-5
    memory_budget_bytes: float | None = None
    trace_steps: tuple[int, ...] = ()
    window: int | str = 1
    shared_ops: str = "exact"
    shared_delay: int = 1
    shared_delays: Mapping[str, int] | None = field(default_factory=dict)
    reduce: str = "exact"
    delay_compensation: str = "predict"
    delay_compensation_coef: float = 1.0
    inflight: str = "count"

    @property
    def cross(self) -> bool:
        """Whether training runs cross-subnet schedules (several subnets in flight, or shared
        ops read late or frozen) rather than one flushed step per subnet."""
        return (self.window != "auto" and self.window > 1) or self.shared_ops != "exact"

    @property
    def split_backward(self) -> bool:
        """Whether each backward is split into B (input gradient) and W (weight gradient):
        ``schedule=zbh1``, flushed or across subnets."""
        return self.schedule == "zbh1"

    def budgets(self, num_stages: int) -> tuple[float, ...] | None:
        return None if self.memory_budget_bytes is None else (float(self.memory_budget_bytes),) * num_stages

    def __post_init__(self) -> None:
        if self.stages is not None and self.stages != "auto" and (
                not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1):
            raise ValueError(f"pipeline.stages: expected a positive integer, 'auto' or null, found {self.stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule: expected one of {list(SCHEDULES)}, found {self.schedule!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"pipeline.planner: expected one of {list(PLANNERS)}, found {self.planner!r}")
        if self.objective not in ("step", "minmax"):
            raise ValueError(f"pipeline.objective: expected 'step' or 'minmax', found {self.objective!r}")
        if not self.migration_overhead_s >= 0:
            raise ValueError(f"pipeline.migration_overhead_s: expected seconds >= 0, found {self.migration_overhead_s!r}")
        if not self.eps >= 0:
            raise ValueError(f"pipeline.eps: expected a number >= 0, found {self.eps!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"pipeline.timeout_s: expected a positive number of seconds, found {self.timeout_s!r}")
        if not self.link_bandwidth > 0 or not self.link_latency_s >= 0:
            raise ValueError(
                "pipeline.link_bandwidth / pipeline.link_latency_s: expected a positive bandwidth and a "
                f"latency >= 0, found {self.link_bandwidth!r} and {self.link_latency_s!r}"
            )
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise ValueError(f"pipeline.memory_budget_bytes: expected a positive number or null, found {self.memory_budget_bytes!r}")
        steps = self.trace_steps
        if (not isinstance(steps, (list, tuple))
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in steps)):
            raise ValueError(f"pipeline.trace_steps: expected a list of step indices (integers >= 0), found {steps!r}")
        object.__setattr__(self, "trace_steps", tuple(sorted(set(steps))))  # from YAML it comes as a list
        for name, lo in (("window", 1), ("shared_delay", 1)):
            v = getattr(self, name)
            if name == "window" and v == "auto":  # the layout chooser's pick (pipeline/layout.py)
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                also = " or 'auto'" if name == "window" else ""
                raise ValueError(f"pipeline.{name}: expected an integer >= {lo}{also}, found {v!r}")
        object.__setattr__(self, "shared_delays", check_delays(self.shared_delays))
        if self.shared_ops not in SHARED_MODES:
            raise ValueError(f"pipeline.shared_ops: expected 'exact', 'delayed' or 'frozen', found {self.shared_ops!r}")
        check_compensation(self.delay_compensation, self.delay_compensation_coef)
        if self.inflight not in ("count", "bytes"):
            raise ValueError(f"pipeline.inflight: expected 'count' or 'bytes', found {self.inflight!r}")
        if self.reduce not in ("exact", "fast"):
            raise ValueError(f"pipeline.reduce: expected 'exact' or 'fast', found {self.reduce!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"pipeline.backend: expected 'auto', 'gloo' or 'nccl', found {self.backend!r}")


def check_delays(delays: Mapping[str, int] | None) -> dict[str, int]:
    """``pipeline.shared_delays`` as a plain dict (None: none; from YAML it may come as a config
    node), or the error that names it: op ids to delays >= 0."""
    if delays is None:
        return {}
    if not isinstance(delays, Mapping):
        raise ValueError(f"pipeline.shared_delays: expected a mapping of op ids to delays, found {delays!r}")
    for op, d in delays.items():
        if not isinstance(op, str) or not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"pipeline.shared_delays: expected op ids to integers >= 0, found {op!r}: {d!r}")
    return dict(delays)


def check_compensation(rule: str, coef: float) -> None:
    """``pipeline.delay_compensation`` and its coefficient, or the error that names them."""
    if rule not in COMPENSATIONS:
        raise ValueError(f"pipeline.delay_compensation: expected one of {list(COMPENSATIONS)}, found {rule!r}")
    ok = isinstance(coef, (int, float)) and not isinstance(coef, bool) and math.isfinite(coef)
    if rule == "step" and not (ok and 0 < coef <= 1):
        raise ValueError(f"pipeline.delay_compensation_coef: expected a step scale in (0, 1] for 'step', found {coef!r}")
    if not (ok and coef >= 0):
        raise ValueError(f"pipeline.delay_compensation_coef: expected a finite number >= 0, found {coef!r}")


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
