"""Saved activations that leave (swap to host, peer) come back in the layout they left with;
views of weights never leave (supernet/activations.py)."""
from __future__ import annotations

import pytest
import torch

from supernet.activations import ActivationPolicy, Layout, _unpack, run_with_policy
from supernet.ops import OpContext


def _views() -> dict[str, torch.Tensor]:
    base = torch.randn(64, 48)
    flat = torch.randn(4099)
    return {
        "contiguous": base.clone(),
        "transposed": base.t(),
        "strided columns": base[:, ::2],
        "rows from the second": base[1:],
        "odd offset": flat[3:3 + 64 * 48].view(64, 48),
        "permuted 3-d": torch.randn(6, 8, 10).permute(2, 0, 1),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_a_swapped_tensor_comes_back_in_its_layout(name: str) -> None:
    t = _views()[name]
    policy = ActivationPolicy({}, min_bytes=0)
    back = _unpack(policy._pack(t))
    assert back is not t and torch.equal(back, t)
    assert back.stride() == t.stride() and back.shape == t.shape
    assert back.data_ptr() % 64 == t.data_ptr() % 64  # the same alignment (the CPU allocator's 64 bytes)
    assert policy.swapped_bytes == t.numel() * t.element_size()


class ContiguousPeer:
    """A stand-in pair that, like the real one (pipeline.memory.peer), sends a contiguous copy."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}

    def put(self, t: torch.Tensor, group: object = None) -> int:
        self.store[len(self.store) + 1] = t.detach().contiguous().clone()
        return len(self.store)

    def get(self, key: int) -> torch.Tensor:
        return self.store.pop(key)


@pytest.mark.parametrize("name", list(_views()))
def test_a_peered_tensor_comes_back_in_its_layout(name: str) -> None:
    t = _views()[name]
    policy = ActivationPolicy({}, min_bytes=0, peer=ContiguousPeer())
    hooks = policy.peer_hooks(group=(0, 0))
    back = hooks.unpack_hook(hooks.pack_hook(t))
    assert torch.equal(back, t) and back.stride() == t.stride() and back.data_ptr() % 64 == t.data_ptr() % 64


def test_overlapping_and_weight_views_stay() -> None:
    policy = ActivationPolicy({}, min_bytes=0)
    expanded = torch.randn(1, 48).expand(64, 48)
    assert not Layout.movable(expanded) and Layout.movable(torch.randn(3, 4).t())
    assert policy._pack(expanded) is expanded
    w = torch.nn.Parameter(torch.randn(32, 16))
    assert policy._pack(w) is w
    assert policy._pack(w.t())._base is w  # the view itself stays, not a copy
    assert policy.swapped_bytes == 0


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                        torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, ctx: OpContext) -> torch.Tensor:
        h = self.body[0](x)
        return self.body[1:](h.t().contiguous().t())  # a non-contiguous activation among the saved ones


def _grads(choice: str | None, device: str) -> tuple[list[torch.Tensor], ActivationPolicy | None]:
    torch.manual_seed(0)
    m = _Linear().to(device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    policy = ActivationPolicy({"a": choice}, min_bytes=0) if choice else None
    run_with_policy(m, [x], OpContext(0, 0, 0, "a", True), policy).square().sum().backward()
    return [x.grad, *(p.grad for p in m.parameters())], policy


def test_only_activations_are_swapped_and_the_gradients_are_the_same() -> None:
    keep, _ = _grads(None, "cpu")
    got, policy = _grads("swap", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, keep))
    assert 0 < policy.swapped_bytes < 4 * 16 * (32 + 64 * 4)  # activations (at most these), no weight copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_on_cuda_gives_keeps_bits_on_the_transformer() -> None:
    """On a GPU a contiguous copy of a transposed operand may round differently (an H100 did):
    swap must give keep's gradients bit for bit on a real transformer subnet."""
    import random

    from distributed import build_graph
    from supernet import build_op
    from supernet.execute import SliceRun, whole_slice
    from supernet.ops import op_contexts

    graph, shape = build_graph("transformer"), (1, 8, 8)
    arch = graph.space().random(random.Random(0))
    out = []
    for choice in (None, "swap"):
        modules = {op.op_id: build_op(op.spec, op.op_id, 0).cuda() for op in graph.active_ops(arch)}
        policy = ActivationPolicy({k: choice for k in modules}, min_bytes=0) if choice else None
        x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(1)).cuda()
        (y,) = SliceRun(whole_slice(graph, arch), modules.__getitem__, op_contexts(0, 0, 0, True),
                        policy=policy).forward([x])
        y.float().square().sum().backward()
        out.append([p.grad for m in modules.values() for p in m.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(*out))
