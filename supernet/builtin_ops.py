"""Built-in ops shared by every space: plumbing (identity, sum, zero) and simple dense ops.

Space-specific ops live beside their space in ``supernet/spaces``; all register by name.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops import OpContext, register_op

__all__ = ["Identity", "Sum", "Zero", "Linear", "MLP", "dropout"]


def dropout(x: torch.Tensor, p: float, ctx: OpContext) -> torch.Tensor:
    """Dropout whose mask comes from ``ctx`` (seed, step, micro-batch, op), not global state."""
    if not ctx.training or p <= 0.0:
        return x
    keep = torch.rand(x.shape, generator=ctx.generator(x.device), device=x.device) >= p
    return x * keep / (1.0 - p)


@register_op("identity")
class Identity(nn.Module):
    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return x


@register_op("zero")
class Zero(nn.Module):
    """The 'none' op of cell spaces: contributes nothing (and passes no gradient back)."""

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return torch.zeros_like(x, requires_grad=False)


@register_op("sum")
class Sum(nn.Module):
    """Adds its inputs left to right (a fixed order, so the result is reproducible)."""

    def forward(self, *xs: torch.Tensor, ctx: OpContext) -> torch.Tensor:
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out


@register_op("linear")
class Linear(nn.Module):
    """A linear layer on the last dim; ``flatten=True`` first flattens all but the batch dim."""

    def __init__(self, d_in: int, d_out: int, flatten: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.flatten = flatten
        self.fc = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        if self.flatten:
            x = x.flatten(1)
        return self.fc(x)


@register_op("mlp")
class MLP(nn.Module):
    """Residual two-layer MLP: x + W2 relu(W1 x), with derived-randomness dropout."""

    def __init__(self, d: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.p = dropout

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return x + dropout(self.fc2(torch.relu(self.fc1(x))), self.p, ctx)
