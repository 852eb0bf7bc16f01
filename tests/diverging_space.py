"""A space built to diverge, for the non-finite loss tests: ``l0``'s ``blowup`` candidate
multiplies its output by infinity at one training step and micro-batch (``space.at_step``,
``space.at_microbatch``), so that step's loss is not finite and, if the step updates the
weights, every later step's is not either. Selected with
``~space +space._target_=tests.diverging_space.build +space.at_step=3``."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from supernet import INPUT, OpContext, OpSpec, SupernetGraph, register_op


@register_op("test_blowup")
class Blowup(nn.Module):
    """x + fc(x), times infinity at training step ``at_step``, micro-batch ``at_microbatch``."""

    def __init__(self, d: int, at_step: int, at_microbatch: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.at = (at_step, at_microbatch)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        y = x + self.fc(x)
        return y * math.inf if ctx.training and (ctx.step, ctx.microbatch) == self.at else y


def build(*, input_shape: Sequence[int], num_classes: int, width: int = 8, at_step: int = 3,
          at_microbatch: int = 1) -> SupernetGraph:
    """Linear stem, ``l0`` (always ``blowup``: one candidate, so every step trains it) and
    ``l1`` among ``linear``/``skip``, linear head."""
    g = SupernetGraph("diverging")
    prev = g.add_fixed("stem", OpSpec.of("linear", d_in=math.prod(input_shape), d_out=width, flatten=True), [INPUT])
    prev = g.add_choice("l0", {"blowup": OpSpec.of("test_blowup", d=width, at_step=at_step,
                                                   at_microbatch=at_microbatch)}, [prev])
    prev = g.add_choice("l1", {"linear": OpSpec.of("linear", d_in=width, d_out=width), "skip": OpSpec.of("identity")},
                        [prev])
    g.add_fixed("head", OpSpec.of("linear", d_in=width, d_out=num_classes), [prev])
    return g
