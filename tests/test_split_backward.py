"""The split backward (B: input gradients now; W: weight gradients later, issue 23 part 4) gives
the whole backward's bits: input gradients, weight gradients and their sum over micro-batches,
on every space, cut anywhere, under every activation choice."""
from __future__ import annotations

import random

import pytest
import torch

from distributed import build_graph, step_data
from supernet import SliceRun, build_op, cut
from supernet.activations import ActivationPolicy
from supernet.execute import classification_loss
from supernet.ops import op_contexts
from supernet.errors import SupernetError

M = 3


def run_subnet(space: str, arch_seed: int, bounds_of, split: bool, policy_of=None, w_late: bool = True):
    """Forward every micro-batch through the cut subnet, then backward stage by stage in
    micro-batch order (B of all micro-batches, then W of all when ``w_late``); returns the
    input gradients each stage handed back and every weight gradient."""
    graph = build_graph(space)
    arch = graph.space().random(random.Random(arch_seed))
    active = graph.active_ops(arch)
    modules = {op.op_id: build_op(op.spec, op.op_id, 0) for op in active}
    slices = cut(active, bounds_of(len(active)), graph.output)
    handed = []
    runs = {}
    for m in range(M):
        x, y = step_data(0, m, 8)
        inputs = [x]
        for s, sl in enumerate(slices):
            policy = policy_of(active) if policy_of else None
            run = SliceRun(sl, modules.__getitem__, op_contexts(0, 0, m, True), policy, split=split)
            outs = run.forward(inputs)
            inputs = [t.detach() for t in outs]
            runs[(s, m)] = run
        runs[("loss", m)] = classification_loss(outs[0], y, 8 * M)
    for m in range(M):
        grads = None
        for s in reversed(range(len(slices))):
            run = runs[(s, m)]
            grads = run.backward_loss(runs[("loss", m)]) if grads is None else run.backward(grads)
            grads = [None if g is None else g.contiguous().clone() for g in grads]
            handed.append(grads)
            if split and not w_late:
                run.backward_weight()
    if split and w_late:
        for s in range(len(slices)):
            for m in range(M):
                runs[(s, m)].backward_weight()
    weights = {op_id + "." + n: p.grad.clone() for op_id, mod in sorted(modules.items())
               for n, p in mod.named_parameters() if p.grad is not None}
    return handed, weights


def same(a, b) -> bool:
    ha, wa = a
    hb, wb = b
    if wa.keys() != wb.keys() or len(ha) != len(hb):
        return False
    return all(torch.equal(wa[k], wb[k]) for k in wa) and all(
        (x is None) == (y is None) and (x is None or torch.equal(x, y)) for gx, gy in zip(ha, hb) for x, y in zip(gx, gy))


CUTS = {
    "whole": lambda n: [0, n],
    "two": lambda n: [0, n // 2, n],
    "three": lambda n: [0, n // 3, 2 * n // 3, n],
    "first-alone": lambda n: [0, 1, n],
}


@pytest.mark.parametrize("space", ["transformer", "conv", "cell"])
@pytest.mark.parametrize("cut_name", sorted(CUTS))
def test_split_backward_is_the_whole_backward(space: str, cut_name: str) -> None:
    for arch_seed in range(2):
        whole = run_subnet(space, arch_seed, CUTS[cut_name], split=False)
        assert whole[1], "the subnet should have weight gradients"
        assert same(whole, run_subnet(space, arch_seed, CUTS[cut_name], split=True)), (space, cut_name, arch_seed)
        assert same(whole, run_subnet(space, arch_seed, CUTS[cut_name], split=True, w_late=False))


@pytest.mark.parametrize("choice", ["swap", "recompute"])
@pytest.mark.parametrize("space", ["transformer", "conv"])
def test_split_backward_under_swap_and_recompute(space: str, choice: str) -> None:
    def policy_of(active):
        return ActivationPolicy({op.op_id: choice for op in active[::2]}, min_bytes=0)

    whole = run_subnet(space, 0, CUTS["two"], split=False, policy_of=policy_of)
    assert same(whole, run_subnet(space, 0, CUTS["two"], split=True, policy_of=policy_of))


def test_b_computes_no_weight_gradient_and_w_only_weights() -> None:
    graph = build_graph("transformer")
    active = graph.active_ops(graph.space().random(random.Random(0)))
    modules = {op.op_id: build_op(op.spec, op.op_id, 0) for op in active}
    sl = cut(active, [0, len(active) // 2, len(active)], graph.output)[1]
    x = torch.randn(8, *step_data(0, 0, 8)[0].shape[1:])
    first = SliceRun(cut(active, [0, len(active) // 2, len(active)], graph.output)[0], modules.__getitem__,
                     op_contexts(0, 0, 0, True))
    inputs = [t.detach() for t in first.forward([x])]
    run = SliceRun(sl, modules.__getitem__, op_contexts(0, 0, 0, True), split=True)
    out = run.forward(inputs)
    grads = run.backward([torch.ones_like(o) for o in out])
    assert any(g is not None for g in grads)
    params = [p for op in sl.ops for p in modules[op.op_id].parameters()]
    assert all(p.grad is None for p in params)
    run.backward_weight()
    assert any(p.grad is not None for p in params)
    with pytest.raises(SupernetError, match="no forward"):
        run.backward([torch.ones_like(o) for o in out])
    with pytest.raises(SupernetError, match="no split backward"):
        run.backward_weight()


def test_a_split_run_refuses_a_second_backward_before_its_weights() -> None:
    graph = build_graph("conv")
    active = graph.active_ops(graph.space().random(random.Random(0)))
    modules = {op.op_id: build_op(op.spec, op.op_id, 0) for op in active}
    sl = cut(active, [0, len(active)], graph.output)[0]
    run = SliceRun(sl, modules.__getitem__, op_contexts(0, 0, 0, True), split=True)
    x, y = step_data(0, 0, 4)
    loss = classification_loss(run.forward([x])[0], y, 4)
    run.backward_loss(loss)
    with pytest.raises(SupernetError, match="waits for its backward_weight"):
        run.backward_loss(loss)
