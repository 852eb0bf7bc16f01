"""The weight-shared supernet module and standalone subnets extracted from it.

``Supernet(graph, seed)`` holds one module per op of the graph (``ops[<slot>/<candidate>]``),
all built by :func:`supernet.ops.build_op` so that each op's initial weights depend only on
``(seed, op_id)``. ``forward(x, arch)`` runs only the active ops; the arch is always an
argument, never state. ``extract(arch)`` copies the active ops into a standalone
:class:`Subnet` that computes the same outputs.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from .graph import INPUT, ActiveOp, SupernetGraph
from .ops import OpContext, build_op, run_op
from .space import Arch

__all__ = ["Supernet", "Subnet", "forward_ops"]


def forward_ops(
    ops: Iterable[ActiveOp], modules: nn.ModuleDict, x: torch.Tensor, output: str,
    seed: int, step: int, microbatch: int, training: bool,
) -> torch.Tensor:
    """Run ``ops`` in order on the data ``x`` with plain autograd and return the output node."""
    env = {INPUT: x}
    for op in ops:
        ctx = OpContext(seed, step, microbatch, op.op_id, training)
        env[op.node] = run_op(modules[op.op_id], [env[s] for s in op.inputs], ctx)
    return env[output]


class Supernet(nn.Module):
    def __init__(self, graph: SupernetGraph, seed: int = 0, op_ids: Iterable[str] | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.seed = seed
        wanted = None if op_ids is None else set(op_ids)
        self.ops = nn.ModuleDict(
            {s.op_id: build_op(s.spec, s.op_id, seed) for s in graph.slots() if wanted is None or s.op_id in wanted}
        )

    def forward(self, x: torch.Tensor, arch: Arch, *, step: int = 0, microbatch: int = 0) -> torch.Tensor:
        return forward_ops(self.graph.active_ops(arch), self.ops, x, self.graph.output,
                           self.seed, step, microbatch, self.training)

    def extract(self, arch: Arch) -> Subnet:
        """A standalone copy of the subnet ``arch`` with its own weights."""
        active = self.graph.active_ops(arch)
        modules = nn.ModuleDict({op.op_id: copy.deepcopy(self.ops[op.op_id]) for op in active})
        sub = Subnet(active, modules, self.graph.output, self.seed)
        sub.train(self.training)
        return sub


class Subnet(nn.Module):
    """One architecture as a plain module: ``subnet(x)``."""

    def __init__(self, active: tuple[ActiveOp, ...], modules: nn.ModuleDict, output: str, seed: int) -> None:
        super().__init__()
        self.active = active
        self.ops = modules
        self.output = output
        self.seed = seed

    def forward(self, x: torch.Tensor, *, step: int = 0, microbatch: int = 0) -> torch.Tensor:
        return forward_ops(self.active, self.ops, x, self.output, self.seed, step, microbatch, self.training)
