"""The resmlp search space: a gated residual MLP with pre-norm blocks and a fixed transition op mid-graph.

Flattened input, a linear stem to ``widths[0]``; ``blocks[0]`` slots ``a0``, ... at that width;
the fixed ``transition`` (layernorm, linear ``widths[0] -> widths[1]``: the width change between
two groups of blocks, as between the stages of a ResNet); ``blocks[1]`` slots ``b0``, ... at
``widths[1]``; a two-branch slot (``fork_l`` and ``fork_r`` read the same input, the fixed ``merge``
adds ``x + fork_l + fork_r``); a head (layernorm, linear).

Block candidates (pre-norm, residual ``x + f(LN(x))``): ``mlp`` (hidden ``2 * width``, GELU),
``gated`` (``sigmoid(W h) * V h`` with ``h = LN(x)``) and ``skip``. Branch candidates: the same
bodies without the residual (``merge`` adds it once) and ``none`` (zeros).

Every subnet runs ``stem``, ``transition``, ``merge`` and ``head``; the three with weights are the
shared ops (``pipeline.shared.shared_ops_of``). ``transition`` sits mid-graph: with the defaults
(widths [24, 32], blocks [4, 1]) a digit goes 64 -> 24 -> a0..a3 -> 32 -> b0 -> fork -> head, 11
active ops with ``transition`` the 6th, 3**7 = 2187 subnets, and the exact 2-stage partition of
the pipeline's cost model puts ``transition`` on stage 0 for some subnets (light blocks before it,
heavy after) and on stage 1 for others (about 56 % and 44 % of them).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SupernetError
from ..graph import INPUT, SupernetGraph
from ..ops import OpContext, OpSpec, register_op
from . import check_input_shape, check_int, reject_unknown

__all__ = ["build", "BLOCK_CANDIDATES", "BRANCH_CANDIDATES"]

BLOCK_CANDIDATES: tuple[str, ...] = ("mlp", "gated", "skip")
BRANCH_CANDIDATES: tuple[str, ...] = ("mlp", "gated", "none")
_OPTIONS = ("widths", "blocks")


def build(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    widths: Sequence[int] = (24, 32),
    blocks: Sequence[int] = (4, 1),
    **unknown: Any,
) -> SupernetGraph:
    """The resmlp supernet graph (see the module docstring)."""
    reject_unknown("resmlp", unknown, ("input_shape", "num_classes", *_OPTIONS))
    shape = check_input_shape("resmlp", input_shape, (1, 2, 3))
    num_classes = check_int("resmlp", "num_classes", num_classes)
    w0, w1 = _pair("widths", widths, minimum=1)
    n0, n1 = _pair("blocks", blocks, minimum=0)

    g = SupernetGraph("resmlp")
    prev = g.add_fixed("stem", OpSpec.of("linear", d_in=math.prod(shape), d_out=w0, flatten=True), [INPUT])
    for i in range(n0):
        prev = g.add_choice(f"a{i}", _blocks(w0), [prev])
    prev = g.add_fixed("transition", OpSpec.of("resmlp_transition", d_in=w0, d_out=w1), [prev])
    for i in range(n1):
        prev = g.add_choice(f"b{i}", _blocks(w1), [prev])
    branches = {
        "mlp": OpSpec.of("resmlp_mlp", d=w1, residual=False),
        "gated": OpSpec.of("resmlp_gated", d=w1, residual=False),
        "none": OpSpec.of("zero"),
    }
    left = g.add_choice("fork_l", branches, [prev])
    right = g.add_choice("fork_r", branches, [prev])
    prev = g.add_fixed("merge", OpSpec.of("sum"), [prev, left, right])
    g.add_fixed("head", OpSpec.of("resmlp_head", d=w1, num_classes=num_classes), [prev])
    return g


def _pair(option: str, value: Any, minimum: int) -> tuple[int, int]:
    """Two ints >= ``minimum``: one per group of blocks, before and after the transition."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise SupernetError(
            f"resmlp.{option}: expected two ints (before and after the transition), found {value!r}"
        )
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise SupernetError(f"resmlp.{option}: expected ints >= {minimum}, found {v!r} in {list(value)}")
    return int(value[0]), int(value[1])


def _blocks(width: int) -> dict[str, OpSpec]:
    return {
        "mlp": OpSpec.of("resmlp_mlp", d=width, residual=True),
        "gated": OpSpec.of("resmlp_gated", d=width, residual=True),
        "skip": OpSpec.of("identity"),
    }


# -- ops -----------------------------------------------------------------------------------
@register_op("resmlp_mlp")
class PreNormMLP(nn.Module):
    """``fc2(gelu(fc1(LN(x))))``, hidden ``2 * d``, plus ``x`` when ``residual``: (batch, d) -> (batch, d)."""

    def __init__(self, d: int, residual: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.residual = residual

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + y if self.residual else y


@register_op("resmlp_gated")
class PreNormGated(nn.Module):
    """``sigmoid(gate(h)) * value(h)`` with ``h = LN(x)``, plus ``x`` when ``residual``: (batch, d) -> (batch, d)."""

    def __init__(self, d: int, residual: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate, self.value = nn.Linear(d, d), nn.Linear(d, d)
        self.residual = residual

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        h = self.norm(x)
        y = torch.sigmoid(self.gate(h)) * self.value(h)
        return x + y if self.residual else y


@register_op("resmlp_transition")
class Transition(nn.Module):
    """Layernorm, linear: the width change between the two groups, (batch, d_in) -> (batch, d_out)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.fc(self.norm(x))


@register_op("resmlp_head")
class Head(nn.Module):
    """Layernorm, linear: (batch, d) -> (batch, num_classes)."""

    def __init__(self, d: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, num_classes)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.fc(self.norm(x))
