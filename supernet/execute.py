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

A split backward (``SliceRun(split=True)``, zero-bubble's B and W) runs the same autograd
nodes in two calls: B those on a path to the slice's inputs (their gradients are what the
stage before waits for), W later the rest, the weight gradients, each node on the same inputs
as in the one call; so its bits are the whole backward's (``tests/test_split_backward.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .errors import SupernetError
from .graph import INPUT, ActiveOp, SupernetGraph
from .activations import ActivationPolicy, run_with_policy
from .ops import OpContext, OpSpec, build_op, run_op
from .space import Arch

__all__ = ["Slice", "cut", "live_across", "whole_slice", "SliceRun", "loss_and_grad", "classification_loss",
           "input_needs_grad"]


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


def whole_slice(graph: SupernetGraph, arch: Arch) -> Slice:
    """The whole subnet ``arch`` as one slice (the single-process engines' unit; cached)."""
    return _whole_slice(graph, arch)


@lru_cache(maxsize=256)
def _whole_slice(graph: SupernetGraph, arch: Arch) -> Slice:
    active = graph.active_ops(arch)
    return cut(active, [0, len(active)], graph.output)[0]


@dataclass(frozen=True)
class _Wiring:
    """How a slice's tensors join its one autograd graph.

    ``link_args``: per op, its arguments that are links: tensors produced in the slice and used
    exactly once, by this op; they flow straight from producer to consumer. ``fan``: tensors used more than once (by ops
    of the slice or handed on): each use gets an alias of its own from :class:`_FanOut`, whose
    backward sums the uses' gradients in the fixed order ``fan[node]`` (indices of the uses in
    forward order: the use handed on first, then the consumers in reverse topological order,
    arguments left to right)."""

    fan: dict[str, tuple[int, ...]]
    link_args: tuple[tuple[int, ...], ...]


@lru_cache(maxsize=512)
def _wiring(sl: Slice) -> _Wiring:
    uses: dict[str, list[tuple[int, int]]] = {}  # node -> (op index, argument) in forward order
    for i, op in enumerate(sl.ops):
        for j, src in enumerate(op.inputs):
            uses.setdefault(src, []).append((i, j))
    n = len(sl.ops)
    for nd in sl.outputs:
        uses.setdefault(nd, []).append((n, 0))  # handed on: after every op
    produced = {op.node for op in sl.ops}
    links = frozenset(nd for nd in produced if len(uses.get(nd, ())) == 1 and nd not in sl.outputs)
    fan = {}
    for nd, us in uses.items():
        if len(us) > 1:
            fold = sorted(range(len(us)), key=lambda k: (-us[k][0], us[k][1]))  # handed on, then later ops first
            fan[nd] = tuple(fold)
    link_args = tuple(tuple(j for j, src in enumerate(op.inputs) if src in links) for op in sl.ops)
    return _Wiring(fan, link_args)


class _FanOut(torch.autograd.Function):
    """``k`` aliases of one tensor whose gradients are summed in a given order (left fold,
    ``None`` skipped, each made contiguous as it would be had it crossed a cut)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fold: tuple[int, ...]):
        ctx.set_materialize_grads(False)
        ctx.fold = fold
        return tuple(x.view_as(x) for _ in fold)

    @staticmethod
    def backward(ctx, *grads):
        acc = None
        for k in ctx.fold:
            g = grads[k]
            if g is not None:
                g = g.contiguous()
                acc = g if acc is None else acc + g
        return acc, None


class SliceRun:
    """One micro-batch on one slice: ``forward`` records, ``backward`` consumes the record.

    The slice is one autograd graph and its backward one autograd call: a tensor used once
    flows straight to its consumer; a tensor used several times is split into aliases whose
    gradients are summed in the fixed order (:class:`_Wiring`) that makes any cut of the
    subnet compute the same bits; the slice's inputs are leaves, their gradients what the
    stage before continues from. A gradient flowing through a single-use link is made
    contiguous, as one arriving across a cut is.
    """

    def __init__(
        self,
        sl: Slice,
        module: Callable[[str], nn.Module],
        ctx: Callable[[str], OpContext],
        policy: ActivationPolicy | None = None,
        split: bool = False,
    ) -> None:
        # ``policy``: per op, keep, swap or recompute its saved activations (None: keep all)
        # ``split``: the backward is split in two (see :meth:`backward`)
        self.slice = sl
        self.split = split
        self._module = module
        self._ctx = ctx
        self._policy = policy
        self._record: tuple[list[torch.Tensor | None], list[torch.Tensor], list[tuple[torch.Tensor, list]]] | None = None
        self._weights: list[tuple[torch.Tensor, torch.Tensor | None, list[nn.Parameter]]] | None = None

    def forward(self, inputs: Sequence[torch.Tensor], grad: bool = True) -> list[torch.Tensor]:
        sl = self.slice
        if len(inputs) != len(sl.inputs):
            raise SupernetError(f"slice forward: expected {len(sl.inputs)} inputs {sl.inputs}, found {len(inputs)}")
        if not grad:
            env = dict(zip(sl.inputs, inputs))
            with torch.no_grad():
                for op in sl.ops:
                    env[op.node] = run_op(self._module(op.op_id), [env[src] for src in op.inputs], self._ctx(op.op_id))
            self._record = None
            return [env[nd] for nd in sl.outputs]
        wiring = _wiring(sl)
        aliases: dict[str, list[torch.Tensor]] = {}
        env: dict[str, torch.Tensor] = {}

        def bind(nd: str, t: torch.Tensor) -> None:
            fold = wiring.fan.get(nd)
            if fold is not None and t.requires_grad:
                aliases[nd] = list(_FanOut.apply(t, fold))[::-1]  # popped in forward order
            else:
                env[nd] = t

        def take(nd: str) -> torch.Tensor:
            stack = aliases.get(nd)
            return stack.pop() if stack else env[nd]

        leaves = [_leaf(nd, t) for nd, t in zip(sl.inputs, inputs)]
        with torch.enable_grad():
            for nd, t, lf in zip(sl.inputs, inputs, leaves):
                bind(nd, lf if lf is not None else t)
            for op, link_args in zip(sl.ops, wiring.link_args):
                args = [take(src) for src in op.inputs]
                if link_args:
                    # a gradient that reaches a fused link non-contiguous is made contiguous, as
                    # one arriving across a cut is; only where this op's backward can make one
                    contiguous = _grads_contiguous(op, args)
                    for j in link_args:
                        if args[j].requires_grad and not contiguous[j]:
                            args[j].register_hook(_contiguous)
                out = run_with_policy(self._module(op.op_id), args, self._ctx(op.op_id), self._policy)
                bind(op.node, out)
            outs = [take(nd) for nd in sl.outputs]
        self._record = (leaves, outs)
        return outs

    def backward(self, out_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Backward through the slice given the gradients of its outputs; returns the
        gradients of its inputs (``None`` where no gradient flows). Frees the record.

        A ``split`` run computes only the input gradients here (B of a split backward, on the
        critical path); the weight gradients wait for :meth:`backward_weight` (W), which frees
        the record."""
        leaves, outs = self._take_record()
        roots = [(o, g) for o, g in zip(outs, out_grads) if g is not None and o.requires_grad]
        return self._backward([o for o, _ in roots], [g for _, g in roots], leaves)

    def backward_loss(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """Backward from a loss computed on this slice's outputs (the last stage): the loss
        is part of the slice's graph, so this is the one autograd call of the micro-batch
        (split: as in :meth:`backward`)."""
        leaves, _ = self._take_record()
        return self._backward([loss], [None], leaves)

    def _backward(self, roots: list[torch.Tensor], grads: list, leaves: list) -> list[torch.Tensor | None]:
        if not roots:
            self._weights = [] if self.split else None
            return [None] * len(leaves)
        if not self.split:
            torch.autograd.backward(roots, grads)
            return [None if lf is None else lf.grad for lf in leaves]
        # B: only the nodes on a path to an input; each node where a path to a weight leaves
        # them (its "boundary") has the gradient it received caught, for W to start from.
        inputs = [lf for lf in leaves if lf is not None]
        edges = _weight_edges(roots, grads, inputs)
        nodes = [node for group, _ in edges.groups for node in group]
        caught: dict = {}
        hooks = [node.register_prehook(lambda g, node=node: caught.__setitem__(node, g)) for node in nodes]
        try:
            if inputs:
                torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        calls = []  # (where W starts, the gradients there, the weights it reaches)
        if edges.roots:
            calls.append((list(edges.roots), list(edges.root_grads), edges.root_params))
        for group, params in edges.groups:
            starts = [(GradientEdge(node, k), g) for node in group for k, g in enumerate(caught.get(node, ()))
                      if g is not None]
            if starts:
                calls.append(([e for e, _ in starts], [g for _, g in starts], params))
        self._weights = calls
        return [None if lf is None else lf.grad for lf in leaves]

    def backward_weight(self) -> None:
        """W of a split backward: the weight gradients, from the nodes where B left the weights'
        paths, with the gradients it caught there: one autograd call per group of weights, each
        reaching only its own weights, so it runs only what B did not (the weight-gradient
        kernels and what lies between them and the weights); then frees the record. Each node
        computes its weight gradients from the same inputs as in the whole backward, so they
        are its bits."""
        if self._weights is None:
            raise SupernetError("slice weight backward: no split backward (SliceRun(split=True), backward) to finish")
        calls, self._weights = self._weights, None
        for starts, grads, params in calls:
            if params:
                torch.autograd.backward(starts, grads, inputs=list(params))
        self._record = None

    def _take_record(self):
        if self._record is None or self._weights is not None:
            raise SupernetError("slice backward: no forward with grad=True to go back through"
                                if self._record is None else
                                "slice backward: this forward's split backward waits for its backward_weight")
        record = self._record
        if not self.split:
            self._record = None
        return record


@dataclass(frozen=True)
class _WeightEdges:
    """Where a split backward's W starts. ``groups``: per group of weights, the nodes B runs
    that lead to them off B's paths (the gradients B catches at those nodes start W there) and
    the weights; a weight reached from several such nodes puts them in one group. ``roots`` and
    ``root_grads``: the roots B does not run at all (no input below them), where W starts
    with every weight below them (``root_params``)."""

    groups: tuple  # ((node, ...), (param, ...)) per group
    roots: tuple
    root_grads: tuple
    root_params: tuple


def _weight_edges(roots: Sequence[torch.Tensor], grads: Sequence, inputs: Sequence[torch.Tensor]) -> _WeightEdges:
    """Walk the autograd graph below ``roots`` once: which nodes lead to an input (B runs
    them), which weights lie below each node off those paths, and where the two part."""
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    order: list = []  # post-order: every node after the nodes below it
    seen: set = set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((nxt, False) for nxt, _ in node.next_functions if nxt is not None and nxt not in seen)
    to_input: dict = {}
    weights: dict = {}  # node off B's paths -> the trainable weights below it (ids -> tensors)
    for node in order:
        below = [nxt for nxt, _ in node.next_functions if nxt is not None]
        to_input[node] = node in input_nodes or any(to_input[n] for n in below)
        if not to_input[node]:  # (so is every node below it)
            var = getattr(node, "variable", None)
            mine = {id(var): var} if var is not None and var.requires_grad else {}
            for n in below:
                mine.update(weights[n])
            weights[node] = mine
    # each node B runs whose children off B's paths lead to weights, with those weights
    starts = []
    for node in order:
        if to_input[node]:
            off = {}
            for n, _ in node.next_functions:
                if n is not None and not to_input[n]:
                    off.update(weights[n])
            if off:
                starts.append((node, off))
    # nodes whose weights overlap share one autograd call (a weight's gradients sum in it)
    groups: list[tuple[list, dict]] = []
    for node, off in starts:
        hit = [g for g in groups if g[1].keys() & off.keys()]
        nodes, params = [node], dict(off)
        for g in hit:
            nodes, params = g[0] + nodes, {**g[1], **params}
            groups.remove(g)
        groups.append((nodes, params))
    cold = [(r, g) for r, g in zip(roots, grads) if r.grad_fn is not None and not to_input[r.grad_fn]]
    root_params: dict = {}
    for r, _ in cold:
        root_params.update(weights[r.grad_fn])
    return _WeightEdges(tuple((tuple(n), tuple(p.values())) for n, p in groups), tuple(r for r, _ in cold),
                        tuple(g for _, g in cold), tuple(root_params.values()))


def _grads_contiguous(op: ActiveOp, args: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """Per argument, whether ``op``'s backward hands it a contiguous gradient (given a
    contiguous gradient of its output); measured once per op and argument shapes by a dry run
    on the meta device, whose tensors carry the same strides. Unknown: False (hook it)."""
    key = (op.op_id, tuple(a.shape for a in args))
    hit = _PROBED.get(key)
    if hit is None:
        sig = tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args)
        try:
            hit = _probe(op.spec, sig)
        except TypeError:  # a spec with unhashable arguments: assume the worst
            hit = (False,) * len(args)
        if len(_PROBED) > 8192:
            _PROBED.clear()
        _PROBED[key] = hit
    return hit


_PROBED: dict[tuple, tuple[bool, ...]] = {}


@lru_cache(maxsize=4096)
def _probe(spec: OpSpec, shapes: tuple) -> tuple[bool, ...]:
    try:
        with torch.device("meta"):
            module = build_op(spec, "probe", 0, seeded=False)
            args = [torch.empty(sh, dtype=dt).requires_grad_(rg) for sh, dt, rg in shapes]
        seen: dict[int, bool] = {}
        for i, a in enumerate(args):
            if a.requires_grad:
                a.register_hook(lambda g, i=i: seen.__setitem__(i, g.is_contiguous()))
        out = run_op(module, args, OpContext(0, 0, 0, "probe", True))
        if out.requires_grad:
            torch.autograd.backward(out, torch.empty(out.shape, dtype=out.dtype, device="meta"))
        return tuple(seen.get(i, True) for i in range(len(args)))
    except Exception:  # an op without meta kernels: hook every link it reads
        return (False,) * len(shapes)


def _contiguous(g: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else g.contiguous()  # None: no gradient reached this tensor


def input_needs_grad(src: str, t: torch.Tensor) -> bool:
    """Whether an op's input ``t`` (from node ``src``) runs as a leaf that requires grad: every
    float input but the data. The engine, the profiler and the cost model all decide it here."""
    return src != INPUT and t.is_floating_point()


def _leaf(src: str, t: torch.Tensor) -> torch.Tensor | None:
    return t.detach().requires_grad_(True) if input_needs_grad(src, t) else None


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
