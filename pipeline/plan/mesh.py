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
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .partition import PartitionProblem, solve, stage_work
from .simulate import simulate

__all__ = ["MeshOption", "mesh_options", "recommend", "reduce_seconds"]


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
