"""The cell search space: stacked NAS-Bench-201 cells, the DAG (non-chain) case.

A cell has nodes 0..3; node 0 is the cell's input, and node j (1..3) is the sum, in the
order i = 0..j-1, of its incoming edges i -> j. Each of the 6 edges is a choice slot
``c{cell}_e{j}_{i}`` among ``none`` (zeros), ``skip`` (identity), ``conv1x1``,
``conv3x3`` (ReLU-Conv-BN) and ``avg_pool3x3``; node j of cell c is the fixed sum op
``c{cell}_n{j}``. The stem is a 3x3 conv and BN; ``cells`` cells follow, all with
``channels`` channels and the input's resolution; the head is BN, ReLU, global average
pooling and a linear layer. As in NB201's weight-sharing searches the BN of the candidate
convs has no affine parameters.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..graph import INPUT, SupernetGraph
from ..ops import OpContext, OpSpec, register_op
from . import check_input_shape, check_int, reject_unknown

__all__ = ["build", "EDGE_CANDIDATES"]

EDGE_CANDIDATES: tuple[str, ...] = ("none", "skip", "conv1x1", "conv3x3", "avg_pool3x3")
NODES = 4


def build(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    channels: int = 8,
    cells: int = 2,
    **unknown: Any,
) -> SupernetGraph:
    """The stacked-cell supernet graph (see the module docstring)."""
    reject_unknown("cell", unknown, ("input_shape", "num_classes", "channels", "cells"))
    shape = check_input_shape("cell", input_shape, (3,))
    num_classes = check_int("cell", "num_classes", num_classes)
    channels = check_int("cell", "channels", channels)
    cells = check_int("cell", "cells", cells)
    cands = {
        "none": OpSpec.of("zero"),
        "skip": OpSpec.of("identity"),
        "conv1x1": OpSpec.of("nb201_relu_conv_bn", channels=channels, kernel=1),
        "conv3x3": OpSpec.of("nb201_relu_conv_bn", channels=channels, kernel=3),
        "avg_pool3x3": OpSpec.of("nb201_avg_pool"),
    }
    g = SupernetGraph("cell")
    prev = g.add_fixed("stem", OpSpec.of("nb201_stem", c_in=shape[0], c_out=channels), [INPUT])
    for c in range(cells):
        nodes = [prev]
        for j in range(1, NODES):
            edges = [g.add_choice(f"c{c}_e{j}_{i}", cands, [nodes[i]]) for i in range(j)]
            nodes.append(g.add_fixed(f"c{c}_n{j}", OpSpec.of("sum"), edges))
        prev = nodes[-1]
    g.add_fixed("head", OpSpec.of("nb201_head", c_in=channels, num_classes=num_classes), [prev])
    return g


# -- ops -----------------------------------------------------------------------------------
@register_op("nb201_stem")
class Stem(nn.Module):
    """3x3 conv and BN: (batch, c_in, H, W) -> (batch, c_out, H, W)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.bn(self.conv(x))


@register_op("nb201_relu_conv_bn")
class ReLUConvBN(nn.Module):
    """ReLU, kxk conv (same padding), BN without affine parameters; shape unchanged."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(channels, affine=False)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.bn(self.conv(torch.relu(x)))


@register_op("nb201_avg_pool")
class AvgPool(nn.Module):
    """3x3 average pooling, stride 1, padding not counted (as in NB201); shape unchanged."""

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


@register_op("nb201_head")
class Head(nn.Module):
    """BN, ReLU, global average pool, linear: (batch, c_in, H, W) -> (batch, num_classes)."""

    def __init__(self, c_in: int, num_classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(x)).mean(dim=(2, 3)))
