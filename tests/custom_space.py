"""A search space defined only in the tests, to check that a user's own space plugs in
through ``_target_`` (``space._target_=tests.custom_space.build``), with its own op."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from supernet import INPUT, OpContext, OpSpec, SupernetGraph, register_op


@register_op("custom_dense")
class Dense(nn.Module):
    """Residual dense layer with a chosen activation: (batch, d) -> (batch, d)."""

    def __init__(self, d: int, act: str) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = {"relu": torch.relu, "tanh": torch.tanh, "gelu": nn.functional.gelu}[act]

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return x + self.act(self.fc(x))


def build(*, input_shape: Sequence[int], num_classes: int, width: int = 16, layers: int = 2,
          candidates: Sequence[str] = ("relu", "tanh", "skip"), op: str = "custom_dense") -> SupernetGraph:
    """Flatten, a linear stem to ``width``, ``layers`` choice slots ``l0``... among
    ``candidates`` (activations of the op ``op``, or ``skip``), a linear head."""
    g = SupernetGraph("custom")
    prev = g.add_fixed("stem", OpSpec.of("linear", d_in=math.prod(input_shape), d_out=width, flatten=True), [INPUT])
    for i in range(layers):
        cands = {c: OpSpec.of("identity") if c == "skip" else OpSpec.of(op, d=width, act=c) for c in candidates}
        prev = g.add_choice(f"l{i}", cands, [prev])
    g.add_fixed("head", OpSpec.of("linear", d_in=width, d_out=num_classes), [prev])
    return g
