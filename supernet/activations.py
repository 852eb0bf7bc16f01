"""Where an op's saved activations wait for its backward: kept, swapped, recomputed, or with the paired stage.

``keep``: autograd holds them on the device (the default). ``swap``: every tensor the op
saves for its backward (except leaves such as weights, and tensors under ``min_bytes``) is
copied to host memory as the forward saves it and back when the backward needs it (pinned
memory and asynchronous copies on CUDA, ordered on the current stream). ``recompute``: only
the op's inputs are kept; its forward runs again inside the backward. An op draws all its
randomness from its derived generator (``OpContext``), so the recomputed forward is the same
one, bit for bit. An op with buffers (batch norm's running statistics) would update them twice
when recomputed, so it is swapped instead. ``peer``: every tensor the op saves (as for a swap) is
handed to the paired pipeline stage as the forward saves it and fetched back when the backward
needs it (``ActivationPolicy.peer``: any object with ``put(tensor, group) -> handle | None`` and
``get(handle) -> tensor``, :class:`pipeline.memory.peer.PeerClient` in a pipeline; ``group``
names the op call's micro-batch, whose tensors are fetched together). Without a peer (one
process, or a stage with no pair) ``peer`` keeps them.

A tensor that comes back has the layout it left with (:class:`Layout`: sizes, strides, and the
address's offset from the allocator's alignment), not a contiguous copy: a GPU's kernels may
round differently for another layout (a transposed operand, another alignment), and an H100
did (``bench/cuda_compose.py``: swap under a budget differed from keep on the transformer).
Views of weights (a ``weight.t()`` that a linear layer saves) are weights, not activations, and
never leave; nor do tensors whose elements overlap (an expanded view).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .ops import OpContext, run_op

__all__ = ["ActivationPolicy", "Layout", "run_with_policy", "CHOICES"]

CHOICES = ("keep", "swap", "recompute", "peer")


_ALIGN = 512  # bytes: CUDA's caching allocator aligns every block to it (the CPU's to 64, which divides it)


@dataclass(frozen=True)
class Layout:
    """Where a tensor's elements sit: sizes, strides and the offset of its first element from an
    ``_ALIGN``-byte boundary (in elements). :meth:`empty` makes a tensor with this layout."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(t: torch.Tensor) -> Layout | None:
        """``t``'s layout; None where a fresh contiguous tensor has it already (contiguous, at
        the alignment). Tensors whose elements overlap are not asked (:meth:`movable`: they stay)."""
        offset = t.data_ptr() % _ALIGN // t.element_size()
        if t.is_contiguous() and offset == 0:
            return None
        return Layout(tuple(t.shape), tuple(t.stride()), offset)

    @staticmethod
    def movable(t: torch.Tensor) -> bool:
        """Whether no two of ``t``'s elements share memory (what a copy to a new home needs)."""
        extent = 0  # the farthest element reached by the dimensions of smaller strides
        for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
            if stride <= extent:
                return False
            extent += stride * (size - 1)
        return True

    def empty(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        span = 1 + sum(st * (sz - 1) for sz, st in zip(self.size, self.stride)) if all(self.size) else 0
        return torch.empty(self.offset + span, dtype=dtype, device=device).as_strided(
            self.size, self.stride, self.offset)


def _restore(t: torch.Tensor, layout: Layout | None, device: torch.device) -> torch.Tensor:
    """``t``'s values on ``device`` in ``layout`` (None: contiguous, ``t`` itself if it is there);
    from the host to a GPU asynchronously, on the current stream."""
    non_blocking = device.type == "cuda" and t.device.type == "cpu"
    if layout is None:
        return t.to(device, non_blocking=non_blocking)
    out = layout.empty(t.dtype, device)
    out.copy_(t, non_blocking=non_blocking)
    return out


class Peer(Protocol):
    """Where ``peer`` activations go: the paired stage (:class:`pipeline.memory.peer.PeerClient`)."""

    def put(self, t: torch.Tensor, group: object = None) -> Any:
        """Send ``t`` away; a handle for :meth:`get`, or None when it cannot carry ``t`` (kept)."""

    def get(self, handle: Any) -> torch.Tensor:
        """The tensor ``put`` sent, unchanged."""


@dataclass
class ActivationPolicy:
    """Per op id a choice (missing: ``keep``); counts what it swapped, recomputed and handed to the pair."""

    choices: Mapping[str, str]
    min_bytes: int = 1024
    swapped_bytes: int = 0
    recomputed_ops: int = 0
    peer: Peer | None = None
    peered_bytes: int = 0

    def choice(self, op_id: str, module: nn.Module) -> str:
        c = self.choices.get(op_id, "keep")
        if c == "recompute" and next(module.buffers(), None) is not None:
            return "swap"  # recomputing would update its buffers twice
        if c == "peer" and self.peer is None:
            return "keep"  # no pair (one process, or a stage that holds rather than gives)
        return c

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def peer_hooks(self, group: object):
        peer = self.peer

        def pack(t: torch.Tensor):
            handle = peer.put(t, group) if self._worth(t) else None
            if handle is None:  # not worth it, or not a tensor the peer can carry
                return t
            self.peered_bytes += t.numel() * t.element_size()
            return _Away(handle, peer, Layout.of(t))

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _worth(self, t: torch.Tensor) -> bool:
        # weights and their views stay where the tensor manager keeps them; small tensors are not
        # worth it; overlapping ones cannot come back as they were
        return (not _weight(t) and (t._base is None or not _weight(t._base))
                and t.numel() * t.element_size() >= self.min_bytes and Layout.movable(t))

    def _pack(self, t: torch.Tensor):
        if not self._worth(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        self.swapped_bytes += host.numel() * host.element_size()
        return t.device, host, Layout.of(t)


def _weight(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


@dataclass(frozen=True)
class _Away:
    """A saved tensor the pair holds: its handle and who to ask."""

    handle: Any
    peer: Peer
    layout: Layout | None


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, _Away):
        back = packed.peer.get(packed.handle)
        return _restore(back, packed.layout, back.device)
    device, host, layout = packed
    return _restore(host, layout, device)


def run_with_policy(module: nn.Module, args: list[torch.Tensor], ctx: OpContext,
                    policy: ActivationPolicy | None) -> torch.Tensor:
    """:func:`supernet.ops.run_op` under the op's activation choice."""
    if policy is None:
        return run_op(module, args, ctx)
    c = policy.choice(ctx.op_id, module)
    if c == "recompute" and torch.is_grad_enabled():
        policy.recomputed_ops += 1
        return checkpoint(_call, module, ctx, *args, use_reentrant=False, preserve_rng_state=False)
    if c == "peer" and torch.is_grad_enabled():
        with policy.peer_hooks((ctx.step, ctx.microbatch)):
            return run_op(module, args, ctx)
    with policy.hooks() if c == "swap" else nullcontext():
        return run_op(module, args, ctx)


def _call(module: nn.Module, ctx: OpContext, *args: torch.Tensor) -> torch.Tensor:
    return run_op(module, list(args), ctx)
