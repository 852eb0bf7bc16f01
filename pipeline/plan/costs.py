"""Op cost tables and the partition problem of one subnet.

A :class:`CostTable` gives, for every op of a supernet at one micro-batch shape, its
:class:`~pipeline.plan.partition.OpCost` (forward/backward seconds, parameter, optimizer-state and
kept-activation bytes) and, for every node, the bytes of its output (what crosses a cut).
``analytic_costs`` derives one without running anything real: each op runs on the *meta*
device under a FLOP counter, so a NASPipe-sized space at width 1024 costs nothing to model.
The measured profiler (``pipeline.profile``) produces the same table from timings.
``subnet_problem`` turns a table and an arch into the partitioner's input.

An analytic table is a pure function of the graph's structure (:func:`graph_digest`), the sample
shape, the micro-batch and the optimizer, so a process keeps the last few it made: the reference
engine, the memory pre-check and each planner ask for it, and a meta-device forward of the conv
space's batch norms costs 0.6 s a time. (The registry's builder for an op kind is taken as fixed
within a process, as the profile cache takes it across processes.)
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from supernet import INPUT, ActiveOp, OpContext, SupernetError, SupernetGraph, build_op
from supernet.execute import input_needs_grad, live_across
from supernet.ops import run_op

from .partition import ManagedMemory, OpCost, PartitionProblem
from .schedule import Schedule

__all__ = ["CostTable", "analytic_costs", "graph_digest", "kept_bytes", "mean_cost", "mean_problem", "optim_bytes",
           "subnet_problem"]


@dataclass(frozen=True)
class CostTable:
    """Per-op costs and per-node output bytes for one supernet at one micro-batch shape."""

    ops: Mapping[str, OpCost]
    out_bytes: Mapping[str, int]
    microbatch: int
    source: str  # "analytic" or "measured:<device>"


def optim_bytes(param_bytes: int, optimizer: str) -> int:
    """Optimizer-state bytes per parameter bytes: SGD keeps a momentum buffer, AdamW two moments."""
    return {"sgd": 1, "adamw": 2}.get(optimizer, 1) * param_bytes


class _ActivationBytes(TorchDispatchMode):
    """Adds up the bytes of every non-view tensor an op's forward creates (≈ what autograd keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def kept_bytes(module: torch.nn.Module, args: list[torch.Tensor], ctx: OpContext) -> int:
    """The bytes one forward of ``module`` leaves alive for its backward: the unique storages
    autograd saves plus the output's, less the op's weights and its inputs (those are counted
    once, as the producer's output or the stage's received cut). What the forward makes and
    frees before it returns is not counted. Works on any device, ``meta`` included (storages
    are told apart by their identity, not their address). ``args`` should be what the engine
    passes: leaves that require grad, the data excepted."""
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    exclude = {key(p) for p in module.parameters()} | {key(a) for a in args}
    saved: dict[int, torch.Tensor] = {}  # holding each tensor keeps its storage (and key) its own

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[key(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_op(module, args, ctx)
    saved[key(out)] = out
    return sum(t.untyped_storage().nbytes() for k, t in saved.items() if k not in exclude)


def graph_digest(graph: SupernetGraph) -> str:
    """sha256 over the supernet's structure: every op's id, node, inputs and spec."""
    rows = [[s.op_id, s.node, list(graph.inputs_of(s.node)), str(s.spec)] for s in graph.slots()]
    return hashlib.sha256(json.dumps([rows, graph.output]).encode()).hexdigest()


_MADE: OrderedDict[tuple, CostTable] = OrderedDict()  # the last analytic tables made, by their arguments


def analytic_costs(
    graph: SupernetGraph,
    sample_shape: tuple[int, ...],
    microbatch: int,
    optimizer: str = "sgd",
    flops_per_s: float = 2e10,
    bytes_per_s: float = 1e10,
    overhead_s: float = 2e-5,
) -> CostTable:
    """A cost table from FLOPs and bytes (no real compute): time = FLOPs / ``flops_per_s`` +
    bytes touched (every tensor the forward makes, and its inputs) / ``bytes_per_s`` + a fixed
    per-op overhead; backward costs twice forward. ``act_bytes`` is what a training forward
    keeps for its backward (:func:`kept_bytes`), as the measured profiler counts it. Kept per
    process by its arguments (the module docstring)."""
    key = (graph_digest(graph), tuple(int(d) for d in sample_shape), int(microbatch), optimizer, flops_per_s,
           bytes_per_s, overhead_s)
    table = _MADE.get(key)
    if table is None:
        table = _MADE[key] = _analytic_costs(graph, tuple(sample_shape), microbatch, optimizer, flops_per_s,
                                             bytes_per_s, overhead_s)
        while len(_MADE) > 8:
            _MADE.popitem(last=False)
    _MADE.move_to_end(key)
    return table


def _analytic_costs(graph: SupernetGraph, sample_shape: tuple[int, ...], microbatch: int, optimizer: str,
                    flops_per_s: float, bytes_per_s: float, overhead_s: float) -> CostTable:
    ops: dict[str, OpCost] = {}
    out_bytes: dict[str, int] = {}
    measured: dict[tuple, tuple] = {}
    with torch.device("meta"):
        env = {INPUT: torch.empty((microbatch, *sample_shape))}
        out_bytes[INPUT] = env[INPUT].numel() * env[INPUT].element_size()
        slots_by_node: dict[str, list] = {}
        for slot in graph.slots():
            slots_by_node.setdefault(slot.node, []).append(slot)
        for node in graph.nodes():
            srcs = graph.inputs_of(node)
            args = [env[src] for src in srcs]
            shapes = tuple(tuple(a.shape) for a in args)
            needs_grad = tuple(input_needs_grad(src, a) for src, a in zip(srcs, args))  # as the engine runs the op
            shape = None
            for slot in slots_by_node[node]:
                # Ops of the same spec on the same inputs cost the same (layers repeat).
                key = (slot.spec, shapes, needs_grad)
                if key not in measured:
                    module = build_op(slot.spec, slot.op_id, 0)
                    counter, made = FlopCounterMode(display=False), _ActivationBytes()
                    with counter, made:
                        out = module(*args, ctx=OpContext(0, 0, 0, slot.op_id, False))
                    pbytes = sum(p.numel() * p.element_size() for p in module.parameters())
                    # what a training forward keeps
                    leaves = [a.detach().requires_grad_(g) for a, g in zip(args, needs_grad)]
                    kept = kept_bytes(module, leaves, OpContext(0, 0, 0, slot.op_id, True))
                    measured[key] = (out, counter.get_total_flops(), made.bytes, pbytes, kept)
                out, flops, made_bytes, pbytes, act_bytes = measured[key]
                if shape is None:
                    shape, env[node] = tuple(out.shape), out
                elif tuple(out.shape) != shape:
                    raise SupernetError(
                        f"node {node!r}: every candidate must produce the same output shape; "
                        f"{slot.op_id!r} gives {tuple(out.shape)}, an earlier candidate gives {shape}"
                    )
                touched = made_bytes + sum(a.numel() * a.element_size() for a in args)
                fwd = flops / flops_per_s + touched / bytes_per_s + overhead_s
                bwd = 2 * flops / flops_per_s + 2 * touched / bytes_per_s + overhead_s
                ops[slot.op_id] = OpCost(slot.op_id, fwd, bwd, pbytes, optim_bytes(pbytes, optimizer), act_bytes)
            out_bytes[node] = env[node].numel() * env[node].element_size()
    return CostTable(ops, out_bytes, microbatch, "analytic")


def subnet_problem(
    graph: SupernetGraph,
    active: tuple[ActiveOp, ...],
    table: CostTable,
    num_stages: int,
    num_microbatches: int,
    schedule: Schedule | str,
    bandwidth: float,
    latency: float,
    memory_budget: tuple[float, ...] | None = None,
    memory: ManagedMemory | None = None,
    in_flight: tuple[int, ...] | None = None,
) -> PartitionProblem:
    """The partition problem of one subnet: its ops' costs in order and the bytes live across
    every possible cut (the same live sets :func:`supernet.execute.cut` sends). ``memory``: the
    tensor manager's memory model (None: everything resident)."""
    live = live_across(active, graph.output)
    cut_bytes = tuple(sum(table.out_bytes[n] for n in nodes) for nodes in live)
    return PartitionProblem(
        ops=tuple(table.ops[op.op_id] for op in active),
        cut_bytes=cut_bytes,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        bandwidth=bandwidth,
        latency=latency,
        memory_budget=memory_budget,
        memory=memory,
        in_flight=in_flight,
    )


def mean_cost(node: str, costs: Sequence[OpCost]) -> OpCost:
    """One op at ``node`` costing the mean of ``costs`` (byte counts rounded to whole bytes)."""
    n = len(costs)
    return OpCost(node, sum(c.fwd for c in costs) / n, sum(c.bwd for c in costs) / n,
                  round(sum(c.param_bytes for c in costs) / n), round(sum(c.optim_bytes for c in costs) / n),
                  round(sum(c.act_bytes for c in costs) / n))


def mean_problem(graph: SupernetGraph, table: CostTable, **problem: object) -> PartitionProblem:
    """The supernet's 'average subnet': each node costs the mean of its candidates. What a
    static planner (PipeDream/torchgpipe style) partitions once. Cuts are those of the subnet
    that picks each slot's first candidate (every node is active in every subnet)."""
    by_node: dict[str, list[OpCost]] = {}
    for slot in graph.slots():
        by_node.setdefault(slot.node, []).append(table.ops[slot.op_id])
    ops = tuple(mean_cost(node, cs) for node, cs in by_node.items())
    first = graph.space().validate({c.label: c.values[0] for c in graph.space().choices})
    live = live_across(graph.active_ops(first), graph.output)
    cut_bytes = tuple(sum(table.out_bytes[n] for n in nodes) for nodes in live)
    return PartitionProblem(ops=ops, cut_bytes=cut_bytes, **problem)
