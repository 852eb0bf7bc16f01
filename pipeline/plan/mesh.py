"""The mesh planner: how many pipeline stages S (and replicas R = N / S) for N processes.

PipeDream's question, for a whole pipeline: the supernet's average subnet is split over S
stages (the partitioner's min-max split); each replica runs M / R micro-batches of the step
through that pipeline, simulated by :func:`pipeline.plan.simulate.simulate` (1F1B, per-stage
forward and backward sums, sends at the link's latency and bandwidth), and each stage's
gradients are reduced across the R replicas once that stage's last backward has run (stages
reduce independently, so a stage's reduction overlaps the backwards still running on the stages
before it). The step ends when the last stage's reduction does. Reducing ``b`` bytes costs, in the exact mode
(:mod:`pipeline.replicas`: a chain of R - 1 hops, then the last replica sends the sum to the
R - 1 others), ``2 (R - 1) (latency + b / bandwidth)``; in a ring all-reduce
``2 (R - 1) (latency + b / (R bandwidth))``. The pick maximises samples per second (the
global batch over pipeline plus reduction), fewer stages on a tie. Pure: values in, values out.

:func:`layout_options` is the chooser ``pipeline.stages=auto`` runs: it prices a sequence of
real subnets (each partitioned over S stages, :class:`~pipeline.plan.admission.SubnetWork` with
the runtime's costs, :mod:`pipeline.plan.overhead`) for every (S, R) and every window W, builds
the schedule the runtime would run (flushed steps: :func:`~pipeline.plan.admission.sequential`;
W > 1: :func:`~pipeline.plan.admission.cross_subnet`) and simulates it whole: seconds per
subnet, updates, reductions and the subnets' collectives included.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .admission import ActivationCap, SubnetWork, cross_subnet, sequential, stage_caps
from .partition import PartitionProblem, solve, stage_work
from .schedule import build as build_schedule
from .simulate import simulate

__all__ = ["LayoutOption", "MeshOption", "layout_options", "meshes", "mesh_options", "recommend", "reduce_seconds",
           "seconds_per_subnet", "pick"]


@dataclass(frozen=True)
class MeshOption:
    """One (S, R) for N = S x R processes and its predicted step."""

    stages: int
    replicas: int
    pipeline_s: float  # one replica's pipeline, M / R micro-batches (simulated)
    reduce_s: float  # what the gradient reductions add after it
    samples_per_s: float

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.reduce_s


def reduce_seconds(grad_bytes: float, replicas: int, bandwidth: float, latency: float, mode: str = "exact") -> float:
    """The time to reduce ``grad_bytes`` over ``replicas`` (exact: chain and fan-out; ring: all-reduce)."""
    if replicas <= 1:
        return 0.0
    per_hop = grad_bytes / bandwidth if mode == "exact" else grad_bytes / (replicas * bandwidth)
    return 2 * (replicas - 1) * (latency + per_hop)


def mesh_options(mean: PartitionProblem, world: int, microbatches: int, microbatch_size: int,
                 bandwidth: float, latency: float, mode: str = "exact") -> list[MeshOption]:
    """Every (S, R) with S x R = ``world``, R dividing ``microbatches`` and S at most the
    number of ops of ``mean`` (the supernet's average subnet at one micro-batch; its
    ``num_stages`` is ignored), by S."""
    out = []
    for s in range(1, world + 1):
        r = world // s
        if world % s or microbatches % r or s > len(mean.ops):
            continue
        problem = PartitionProblem(ops=mean.ops, cut_bytes=mean.cut_bytes, num_stages=s,
                                   num_microbatches=microbatches // r, bandwidth=bandwidth, latency=latency)
        b = solve(problem).bounds
        stage_ops = [mean.ops[b[k]:b[k + 1]] for k in range(s)]
        fwd, bwd, sends = stage_work(problem, b)
        sim = simulate(problem.schedule, fwd, bwd, sends, sends)  # the problem's default: 1F1B
        ends = [max(sp.end for sp in row) for row in sim.timeline]
        reduce = [reduce_seconds(sum(o.param_bytes for o in ops), r, bandwidth, latency, mode) for ops in stage_ops]
        step = max(e + red for e, red in zip(ends, reduce))
        pipe = max(ends)
        out.append(MeshOption(s, r, pipe, step - pipe, microbatches * microbatch_size / step))
    return out


def recommend(options: Sequence[MeshOption]) -> MeshOption:
    """The option with the most samples per second (fewer stages on a tie)."""
    if not options:
        raise ValueError("pipeline.stages: no (stages, replicas) fits the world size and train.microbatches")
    return max(options, key=lambda o: (round(o.samples_per_s, 9), -o.stages))


@dataclass(frozen=True)
class LayoutOption:
    """One (S, R, W) and its predicted seconds per subnet (one training step)."""

    stages: int
    replicas: int
    window: int
    step_s: float
    samples_per_s: float

    def to_json(self) -> dict:
        return {"stages": self.stages, "replicas": self.replicas, "window": self.window,
                "step_ms": round(1e3 * self.step_s, 3), "samples_per_s": round(self.samples_per_s, 1)}


def meshes(world: int, microbatches: int, max_stages: int) -> list[tuple[int, int]]:
    """Every (S, R) with S x R = ``world``, R dividing ``microbatches``, S <= ``max_stages``."""
    return [(s, world // s) for s in range(1, min(world, max_stages) + 1)
            if world % s == 0 and microbatches % (world // s) == 0]


def seconds_per_subnet(work: Sequence[SubnetWork], microbatches: int, window: int, schedule: str = "1f1b", *,
                       frozen: frozenset[str] = frozenset(), delayed: frozenset[str] = frozenset(),
                       delay: int = 0, delays: Mapping[str, int] | None = None,
                       kept: Sequence[Sequence[int]] | None = None) -> float:
    """The simulated makespan of ``work`` (subnets in training order, each over the same S
    stages, ``microbatches`` each) run as the runtime runs it, per subnet: flushed steps of
    ``schedule`` at ``window`` 1, the admission builder's cross-subnet schedule above (with every
    backward split when ``schedule`` is ``zbh1``, as the runtime splits them); ``delays``: a
    delayed op's own delay where not ``delay``; ``kept``: per subnet and stage, the activation
    bytes a micro-batch keeps there, for the in-flight cap in bytes (``pipeline.inflight=bytes``,
    :class:`~pipeline.plan.admission.ActivationCap`; None: the count cap)."""
    P = len(work[0].uses)
    uses = [w.uses for w in work]
    if window == 1:
        sch = sequential(build_schedule(schedule, P, microbatches), uses, frozen=frozen, delayed=delayed, delay=delay,
                         delays=delays)
    else:
        split = schedule == "zbh1"
        sch = cross_subnet(work, microbatches, window, frozen=frozen, delayed=delayed, delay=delay, split=split,
                           delays=delays, activations=ActivationCap.like(stage_caps(P, split), kept) if kept else None)
    return simulate(sch, work=work).step_time / len(work)


def layout_options(works: dict[tuple[int, int], Sequence[SubnetWork]], microbatches: int, batch_size: int,
                   windows: Sequence[int] = (1,), schedule: str = "1f1b", *, frozen: frozenset[str] = frozenset(),
                   delayed: frozenset[str] = frozenset(), delay: int = 0,
                   delays: Mapping[str, int] | None = None,
                   kept: Mapping[tuple[int, int], Sequence[Sequence[int]]] | None = None) -> list[LayoutOption]:
    """Every (S, R) of ``works`` (its subnets' work, priced for that mesh: M / R micro-batches,
    reductions over R) with every window in ``windows`` (one stage has no bubble to fill: S = 1
    only with the smallest), by S then W. ``kept``: per (S, R), the subnets' activation bytes per
    micro-batch and stage, for the in-flight cap in bytes (None: the count cap)."""
    out = []
    for (s, r), work in sorted(works.items()):
        for w in sorted(set(windows)):
            if s == 1 and w != min(windows):
                continue
            step = seconds_per_subnet(work, microbatches // r, w, schedule, frozen=frozen, delayed=delayed,
                                      delay=delay, delays=delays, kept=kept.get((s, r)) if kept else None)
            out.append(LayoutOption(s, r, w, step, batch_size / step if step > 0 else float("inf")))
    return out


def pick(options: Sequence[LayoutOption]) -> LayoutOption:
    """The option with the most samples per second; on a tie (within 1 %) fewer stages, then the
    smaller window (fewer messages and less to go wrong for the same predicted speed)."""
    if not options:
        raise ValueError("pipeline.stages: no (stages, replicas) fits the world size and train.microbatches")
    best = max(o.samples_per_s for o in options)
    return min((o for o in options if o.samples_per_s >= 0.99 * best), key=lambda o: (o.stages, o.window))
