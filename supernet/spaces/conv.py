"""The conv search space: a single-path one-shot (SPOS-style) ConvNet of inverted-residual slots.

Stem (3x3 conv, BN, ReLU) to ``channels[0]``; then ``layers`` slots ``layer00``, ... each
choosing a MobileNetV2 inverted-residual block ``k{k}e{e}`` (kernel ``k``, expansion ``e``),
plus ``skip`` (identity) where a slot's input and output shapes match; then global average
pooling and a linear head. The layers listed in ``downsample_at`` have stride 2 and start a
new stage; stage ``s`` has ``channels[s]`` channels (an int ``channels`` is every stage's).

With the defaults (4 layers, channels [8, 16], downsample at layer 2) an 8x8 image goes
8x8x8 -> 8x8x8 -> 4x4x16 -> 4x4x16 -> pool -> linear.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import SupernetError
from ..graph import INPUT, SupernetGraph
from ..ops import OpContext, OpSpec, register_op
from . import check_input_shape, check_int, check_int_list, reject_unknown

__all__ = ["build"]

_OPTIONS = ("layers", "channels", "kernels", "expansions", "allow_skip", "downsample_at")


def build(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    layers: int = 4,
    channels: int | Sequence[int] = (8, 16),
    kernels: Sequence[int] = (3, 5),
    expansions: Sequence[int] = (3, 6),
    allow_skip: bool = True,
    downsample_at: Sequence[int] = (2,),
    **unknown: Any,
) -> SupernetGraph:
    """The SPOS-style ConvNet supernet graph (see the module docstring)."""
    reject_unknown("conv", unknown, ("input_shape", "num_classes", *_OPTIONS))
    shape = check_input_shape("conv", input_shape, (3,))
    num_classes = check_int("conv", "num_classes", num_classes)
    layers = check_int("conv", "layers", layers)
    kernels = check_int_list("conv", "kernels", kernels)
    if any(k % 2 == 0 for k in kernels):
        raise SupernetError(f"conv.kernels: expected odd kernel sizes (same padding), found {list(kernels)}")
    expansions = check_int_list("conv", "expansions", expansions)
    if not isinstance(allow_skip, bool):
        raise SupernetError(f"conv.allow_skip: expected true or false, found {allow_skip!r}")
    down = sorted(check_int_list("conv", "downsample_at", downsample_at, minimum=0, allow_empty=True))
    if down and down[-1] >= layers:
        raise SupernetError(
            f"conv.downsample_at: expected layer indices in [0, {layers - 1}] (layers={layers}), found {list(down)}"
        )
    stages = len(down) + 1
    if isinstance(channels, int) and not isinstance(channels, bool):
        widths = (check_int("conv", "channels", channels),) * stages
    else:
        if isinstance(channels, (str, bytes)) or not isinstance(channels, Sequence):
            raise SupernetError(f"conv.channels: expected an int or a list of ints, found {channels!r}")
        widths = tuple(channels)
        if len(widths) != stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in widths):
            raise SupernetError(
                f"conv.channels: expected an int or {stages} positive ints (one per stage: "
                f"len(downsample_at) + 1), found {list(widths)}"
            )

    g = SupernetGraph("conv")
    prev = g.add_fixed("stem", OpSpec.of("spos_stem", c_in=shape[0], c_out=widths[0]), [INPUT])
    c_in, stage = widths[0], 0
    digits = max(2, len(str(layers - 1)))
    for i in range(layers):
        stride = 2 if i in down else 1
        stage += stride == 2
        c_out = widths[stage]
        cands = {
            f"k{k}e{e}": OpSpec.of("mbconv", c_in=c_in, c_out=c_out, kernel=k, expansion=e, stride=stride)
            for k in kernels
            for e in expansions
        }
        if allow_skip and stride == 1 and c_in == c_out:
            cands["skip"] = OpSpec.of("identity")
        prev = g.add_choice(f"layer{i:0{digits}d}", cands, [prev])
        c_in = c_out
    g.add_fixed("head", OpSpec.of("spos_head", c_in=c_in, num_classes=num_classes), [prev])
    return g


# -- ops -----------------------------------------------------------------------------------
@register_op("spos_stem")
class Stem(nn.Module):
    """3x3 conv, BN, ReLU: (batch, c_in, H, W) -> (batch, c_out, H, W)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@register_op("mbconv")
class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, BN, ReLU6, kxk depthwise (stride), BN, ReLU6, 1x1
    project, BN; plus the input when stride is 1 and the channels match."""

    def __init__(self, c_in: int, c_out: int, kernel: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = c_in * expansion
        expand: list[nn.Module] = (
            [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()] if expansion != 1 else []
        )
        self.body = nn.Sequential(
            *expand,
            nn.Conv2d(hidden, hidden, kernel, stride=stride, padding=kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


@register_op("spos_head")
class Head(nn.Module):
    """Global average pool, linear: (batch, c_in, H, W) -> (batch, num_classes)."""

    def __init__(self, c_in: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))
