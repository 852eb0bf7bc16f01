"""The runtime cost model: what a real step costs beyond its ops' compute, as one value.

A cost table (:mod:`pipeline.plan.costs`, :mod:`pipeline.profile`) prices each op's forward and
backward. A real step also pays, on this machine, for what runs around the ops: every forward
or backward action's Python and dispatch (the executor, the slice's autograd set-up, its
messages posted), every update action's optimizer call, a few collectives per subnet (the loss
gather, the agreement check), and every message's latency and bandwidth on the transport.
:class:`RuntimeCosts` holds those figures; :mod:`pipeline.calibrate` measures them at start-up
(a few ping-pongs over the process group, a few timed tiny actions; cached per machine), and the
layout chooser (:mod:`pipeline.plan.mesh`), the planner and the admission builder price a
stage's work with them:

* forward / backward of stage s: the table's op seconds x ``compute_scale`` (the table is timed
  on an idle core; the ranks of a job on shared cores compute slower: measured at start-up, not
  cached) + ``action_s``;
* a message of ``b`` bytes in ``k`` buffers: ``k * latency_s + b / bandwidth``;
* an update of a stage: ``update_s + update_op_s * ops + update_byte_s * parameter bytes`` and,
  with R replicas, the exact reduction (:meth:`RuntimeCosts.reduce_s`);
* per subnet on every stage, ``step_s`` (its collectives: the loss gather, the agreement),
  spread over the subnet's forwards.

Pure: values in, values out.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .admission import SubnetWork
from .partition import PartitionProblem, stage_work

__all__ = ["PACKED_BUFFERS", "RuntimeCosts", "fit_line", "stage_seconds", "subnet_work"]

# A reduction's message (pipeline.replicas) is payload only: a presence mask, the gradients flat
# per dtype, the batch-norm statistics flat per dtype (and the losses): about three buffers.
PACKED_BUFFERS = 3


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds a step pays beyond its ops' compute (the module doc). ``source``: where the
    figures come from (``assumed``: the defaults below, nothing measured)."""

    action_s: float = 0.0  # one forward or backward action, beyond its ops' compute
    update_s: float = 0.0  # one update action: the optimizer call and the losses read
    update_op_s: float = 0.0  # per op stepped
    update_byte_s: float = 0.0  # per byte of parameters stepped
    step_s: float = 0.0  # per subnet on every stage: its collectives (losses, agreement)
    latency_s: float = 5e-5  # one point-to-point message
    bandwidth: float = 1e9  # bytes/s on the link
    compute_scale: float = 1.0  # the table's op seconds x this: ranks computing at once on shared cores
    source: str = "assumed"

    def __post_init__(self) -> None:
        for name in ("action_s", "update_s", "update_op_s", "update_byte_s", "step_s", "latency_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"RuntimeCosts.{name}: expected finite seconds >= 0, found {v!r}")
        for name in ("bandwidth", "compute_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"RuntimeCosts.{name}: expected a positive finite number, found {v!r}")

    def message_s(self, nbytes: float, buffers: int = 1) -> float:
        """One message of ``nbytes`` in ``buffers`` buffers (each a message on the wire)."""
        return buffers * self.latency_s + nbytes / self.bandwidth

    def update_seconds(self, ops: int, param_bytes: float) -> float:
        """One stage's update of ``ops`` ops holding ``param_bytes`` of parameters."""
        if ops == 0:
            return self.update_s
        return self.update_s + self.update_op_s * ops + self.update_byte_s * param_bytes

    def reduce_s(self, grad_bytes: float, replicas: int, mode: str = "exact") -> float:
        """Reducing one stage's ``grad_bytes`` over ``replicas``: exact, a chain of R - 1
        payload-only hops then R - 1 sends of the sum (:mod:`pipeline.replicas`); ``fast``, one
        ring all-reduce (2 (R - 1) steps of 1/R of the bytes)."""
        if replicas <= 1:
            return 0.0
        if mode == "exact":
            return 2 * (replicas - 1) * self.message_s(grad_bytes, PACKED_BUFFERS)
        return 2 * (replicas - 1) * self.message_s(grad_bytes / replicas)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: dict) -> RuntimeCosts:
        return cls(**{k: (str(v) if k == "source" else float(v)) for k, v in d.items() if k in cls.__dataclass_fields__})


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``y = a + b x`` with ``a, b >= 0``, least squares in *relative* error (weights 1 / y^2),
    so that a 4-byte message's 50 us counts as much as a 4 MiB message's 5 ms: a link's latency
    and seconds per byte from timed messages of sizes spanning orders of magnitude. A negative
    coefficient is clamped to 0 and the other refitted."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"fit_line: expected as many sizes as times (at least one), found {len(xs)} and {len(ys)}")
    w = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swy = sum(wi * y for wi, y in zip(w, ys))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * swxx - swx * swx
    if det > 0:
        a, b = (swy * swxx - swx * swxy) / det, (sw * swxy - swx * swy) / det
        if a >= 0 and b >= 0:
            return a, b
    if swxx > 0:  # through the origin (no fixed cost), or a constant (no cost per byte)
        b0 = swxy / swxx
        a1 = swy / sw
        err0 = sum(wi * (b0 * x - y) ** 2 for wi, x, y in zip(w, xs, ys))
        err1 = sum(wi * (a1 - y) ** 2 for wi, y in zip(w, ys))
        return (0.0, max(0.0, b0)) if b0 > 0 and err0 <= err1 else (max(0.0, a1), 0.0)
    return max(0.0, swy / sw), 0.0


def stage_seconds(problem: PartitionProblem, bounds: Sequence[int], costs: RuntimeCosts,
                  self_describing: bool = False) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per stage, one micro-batch's forward and backward seconds (the table's ops x
    ``compute_scale``, plus ``action_s``), and per cut the message's seconds (at ``costs``'
    link: the tensors crossing it counted as one buffer; ``self_describing``: a header first,
    as cross-subnet schedules send)."""
    fwd, bwd, _ = stage_work(problem, bounds)
    send = tuple(costs.message_s(problem.cut_bytes[b], 2 if self_describing else 1) for b in bounds[1:-1])
    k, a = costs.compute_scale, costs.action_s
    return tuple(k * f + a for f in fwd), tuple(k * b + a for b in bwd), send


def subnet_work(problem: PartitionProblem, bounds: Sequence[int], uses: Sequence[frozenset[str]],
                costs: RuntimeCosts, replicas: int = 1, reduce: str = "exact", extra_s: float = 0.0,
                self_describing: bool = False) -> SubnetWork:
    """One subnet's :class:`~pipeline.plan.admission.SubnetWork` priced with ``costs``: each
    stage's update carries the optimizer step of its ops and, with ``replicas`` > 1, the
    reduction of its gradients (the update waits for it); what every stage pays once per subnet
    besides, the subnet's collectives (``step_s``) and ``extra_s`` (its planning where no core
    is spare), is spread over its forwards (it takes the stage's core, not a place in the
    schedule; an update would wait for the last stage's, which the executor does not)."""
    fwd, bwd, send = stage_seconds(problem, bounds, costs, self_describing)
    per_forward = (costs.step_s + extra_s) / problem.num_microbatches
    update = []
    for s in range(len(bounds) - 1):
        ops = problem.ops[bounds[s]:bounds[s + 1]]
        pbytes = sum(o.param_bytes for o in ops)
        update.append(costs.update_seconds(len(ops), pbytes) + costs.reduce_s(pbytes, replicas, reduce))
    return SubnetWork(tuple(uses), tuple(f + per_forward for f in fwd), bwd, send, tuple(update))
