"""Op-by-op execution of a slice of a subnet: forward, then backward with a fixed gradient order.

This is the one code path that both the single-process reference trainer (one slice holding
every active op) and each pipeline stage (its own slice) run. A run of ops whose outputs each
have one consumer runs as one autograd graph; a tensor with several consumers, and every input
of a slice, is a detached leaf, and its gradient is summed in a fixed order (consumers in
reverse topological order, arguments left to right). A pipeline stage receives the partial sum
from the stages after it and continues the same sum, so cutting a subnet anywhere leaves every
floating-point operation, and its order, unchanged. That is what makes the pipeline
bit-identical to the reference, on DAGs too.

Across a cut a tensor is either a real tensor or ``None`` ("no gradient flows"), which keeps
ops whose outputs get no gradient from receiving a zero gradient (and a weight-decay update)
in the pipeline that they would not get in the reference.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SupernetError
from .graph import INPUT, ActiveOp, SupernetGraph
from .ops import OpContext, run_op
from .space import Arch

__all__ = ["Slice", "cut", "live_across", "whole_slice", "SliceRun", "loss_and_grad", "classification_loss"]


@dataclass(frozen=True)
class Slice:
    """The part of one subnet that one stage runs: ``ops`` in order, what it receives
    (``inputs``, node names) and what it hands on (``outputs``)."""

    ops: tuple[ActiveOp, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def live_across(active: Sequence[ActiveOp], output: str) -> list[tuple[str, ...]]:
    """For each boundary position i in 0..len(active) (just before op i), the nodes live across
    it: produced before i (the data counts as produced before 0) and used at or after i (the
    graph output is used by the loss, after the last op). Ordered data first, then op order."""
    n = len(active)
    pos = {INPUT: -1}
    for i, op in enumerate(active):
        pos[op.node] = i
    last = dict(pos)
    for i, op in enumerate(active):
        for src in op.inputs:
            if src not in pos:
                raise SupernetError(f"op {op.op_id!r} reads {src!r}, which no active op produces")
            last[src] = max(last[src], i)
    if output not in pos:
        raise SupernetError(f"graph output {output!r} is not produced by any active op")
    last[output] = n
    order = [INPUT] + [op.node for op in active]
    return [tuple(nd for nd in order if pos[nd] < i <= last[nd]) for i in range(n + 1)]


def cut(active: Sequence[ActiveOp], bounds: Sequence[int], output: str) -> tuple[Slice, ...]:
    """Cut ordered active ops into contiguous slices at ``bounds`` = [0, b1, ..., len(active)].

    Every tensor live across a cut crosses it: a tensor produced before stage s and used at
    stage s or later is an input of stage s (relayed through stages that do not use it). The
    first stage receives the data (``"input"``); the last hands on the graph output.
    """
    n, p = len(active), len(bounds) - 1
    if p < 1 or bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise SupernetError(f"cut bounds: expected non-decreasing [0, ..., {n}], found {list(bounds)}")
    live = live_across(active, output)
    return tuple(
        Slice(
            tuple(active[bounds[s] : bounds[s + 1]]),
            (INPUT,) if s == 0 else live[bounds[s]],
            (output,) if s == p - 1 else live[bounds[s + 1]],
        )
        for s in range(p)
    )


@dataclass(frozen=True)
class _Links:
    """Which tensors of a slice flow straight from producer to consumer inside one autograd
    graph: produced by an op of the slice, used exactly once, by another op of the slice (not
    handed on). Every other float tensor an op reads is a detached leaf, whose gradient joins
    the fixed-order sum."""

    nodes: frozenset[str]


@lru_cache(maxsize=512)
def _links(sl: Slice) -> _Links:
    uses: dict[str, int] = {}
    for op in sl.ops:
        for src in op.inputs:
            uses[src] = uses.get(src, 0) + 1
    for nd in sl.outputs:
        uses[nd] = uses.get(nd, 0) + 1
    produced = {op.node for op in sl.ops}
    return _Links(frozenset(nd for nd in produced if uses.get(nd, 0) == 1 and nd not in sl.outputs))


def whole_slice(graph: SupernetGraph, arch: Arch) -> Slice:
    """The whole subnet ``arch`` as one slice (the single-process engines' unit; cached)."""
    return _whole_slice(graph, arch)


@lru_cache(maxsize=256)
def _whole_slice(graph: SupernetGraph, arch: Arch) -> Slice:
    active = graph.active_ops(arch)
    return cut(active, [0, len(active)], graph.output)[0]


class SliceRun:
    """One micro-batch on one slice: ``forward`` records, ``backward`` consumes the record.

    A run of ops where each output has exactly one consumer runs as one autograd graph, and
    its backward is one autograd call (``leaner``: one call per slice for a chain instead of
    one per op). Tensors with several consumers, and the slice's inputs, are detached leaves:
    their gradient is summed in the fixed order (consumers in reverse topological order,
    arguments left to right) that makes any cut of the subnet compute the same bits. A
    gradient flowing through a fused link is made contiguous, as one arriving across a cut is.
    """

    def __init__(
        self,
        sl: Slice,
        module: Callable[[str], nn.Module],
        ctx: Callable[[str], OpContext],
    ) -> None:
        self.slice = sl
        self._module = module
        self._ctx = ctx
        self._records: list[tuple[ActiveOp, list[torch.Tensor | None], torch.Tensor]] | None = None

    def forward(self, inputs: Sequence[torch.Tensor], grad: bool = True) -> list[torch.Tensor]:
        sl = self.slice
        if len(inputs) != len(sl.inputs):
            raise SupernetError(f"slice forward: expected {len(sl.inputs)} inputs {sl.inputs}, found {len(inputs)}")
        env = dict(zip(sl.inputs, inputs))
        records = []
        links = _links(sl).nodes if grad else frozenset()
        with torch.set_grad_enabled(grad):
            for op in sl.ops:
                if grad:
                    leaves = [None if src in links else _leaf(src, env[src]) for src in op.inputs]
                    args = [lf if lf is not None else env[src] for lf, src in zip(leaves, op.inputs)]
                else:
                    leaves, args = [], [env[src] for src in op.inputs]
                out = run_op(self._module(op.op_id), args, self._ctx(op.op_id))
                env[op.node] = out
                if grad:
                    if op.node in links and out.requires_grad:
                        out.register_hook(_contiguous)
                    records.append((op, leaves, out))
        self._records = records if grad else None
        return [env[nd] for nd in sl.outputs]

    def backward(self, out_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Backward through the slice given the gradients of its outputs; returns the
        gradients of its inputs (``None`` where no gradient flows). Frees the record."""
        if self._records is None:
            raise SupernetError("slice backward: no forward with grad=True to go back through")
        sl = self.slice
        links = _links(sl).nodes
        acc: dict[str, torch.Tensor] = {nd: g for nd, g in zip(sl.outputs, out_grads) if g is not None}
        for op, leaves, out in reversed(self._records):
            if op.node not in links:
                # the end of a fused run: every consumer of its output is done, so the sum is whole
                g = acc.pop(op.node, None)
                if g is None or not out.requires_grad:
                    continue
                torch.autograd.backward(out, g)
            for src, leaf in zip(op.inputs, leaves):
                if leaf is not None and leaf.grad is not None:
                    acc[src] = acc[src] + leaf.grad if src in acc else leaf.grad
        self._records = None
        return [acc.get(nd) for nd in sl.inputs]


def _contiguous(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def _leaf(src: str, t: torch.Tensor) -> torch.Tensor | None:
    if src == INPUT or not t.is_floating_point():
        return None
    return t.detach().requires_grad_(True)


def classification_loss(logits: torch.Tensor, target: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch and divided by the whole batch's size, so
    the micro-batch losses add up to the batch mean."""
    return F.cross_entropy(logits, target, reduction="sum") / batch_size


def loss_and_grad(
    logits: torch.Tensor, target: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch loss and its gradient with respect to the logits."""
    leaf = logits.detach().requires_grad_(True)
    loss = classification_loss(leaf, target, batch_size)
    loss.backward()
    return loss.detach(), leaf.grad
