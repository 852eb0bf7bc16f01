"""Where an op's saved activations wait for its backward: kept, swapped to host memory, or recomputed.

``keep``: autograd holds them on the device (the default). ``swap``: every tensor the op
saves for its backward (except leaves such as weights, and tensors under ``min_bytes``) is
copied to host memory as the forward saves it and back when the backward needs it (pinned
memory and asynchronous copies on CUDA, ordered on the current stream). ``recompute``: only
the op's inputs are kept; its forward runs again inside the backward. An op draws all its
randomness from its derived generator (``OpContext``), so the recomputed forward is the same
one, bit for bit. An op with buffers (batch norm's running statistics) would update them twice
when recomputed, so it is swapped instead.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .ops import OpContext, run_op

__all__ = ["ActivationPolicy", "run_with_policy", "CHOICES"]

CHOICES = ("keep", "swap", "recompute")


@dataclass
class ActivationPolicy:
    """Per op id a choice (missing: ``keep``); counts what it swapped and recomputed."""

    choices: Mapping[str, str]
    min_bytes: int = 1024
    swapped_bytes: int = 0
    recomputed_ops: int = 0

    def choice(self, op_id: str, module: nn.Module) -> str:
        c = self.choices.get(op_id, "keep")
        if c == "recompute" and next(module.buffers(), None) is not None:
            return "swap"  # recomputing would update its buffers twice
        return c

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        if (t.is_leaf and t.requires_grad) or t.numel() * t.element_size() < self.min_bytes:
            return t  # weights stay where the tensor manager keeps them; small tensors are not worth it
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        self.swapped_bytes += host.numel() * host.element_size()
        return t.device, host


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
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
    with policy.hooks() if c == "swap" else nullcontext():
        return run_op(module, args, ctx)


def _call(module: nn.Module, ctx: OpContext, *args: torch.Tensor) -> torch.Tensor:
    return run_op(module, list(args), ctx)
