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

__all__ = ["ActivationPolicy", "run_with_policy", "CHOICES"]

CHOICES = ("keep", "swap", "recompute", "peer")


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
            return _Away(handle, peer)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _worth(self, t: torch.Tensor) -> bool:
        # weights stay where the tensor manager keeps them; small tensors are not worth it
        return not (t.is_leaf and t.requires_grad) and t.numel() * t.element_size() >= self.min_bytes

    def _pack(self, t: torch.Tensor):
        if not self._worth(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        self.swapped_bytes += host.numel() * host.element_size()
        return t.device, host


@dataclass(frozen=True)
class _Away:
    """A saved tensor the pair holds: its handle and who to ask."""

    handle: Any
    peer: Peer


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, _Away):
        return packed.peer.get(packed.handle)
    device, host = packed
    return host.to(device, non_blocking=device.type == "cuda")


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
