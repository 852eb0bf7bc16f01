"""The transformer search space: a token stem, ``layers`` block slots, and a pooling head.

The stem turns one sample of shape (C, H, W) into H tokens of C*W features (a sample of
shape (L, F) is already L tokens of F features), projects them to ``width`` and adds a
learned positional embedding. Each slot ``layer00``, ``layer01``, ... chooses one candidate
block; every block is residual, ``x + dropout(f(LN(x)))``, (batch, seq, width) -> same.
The head is layernorm, mean over tokens, linear to ``num_classes``.

Candidates are named by pattern (``h`` heads must divide ``width``; kernels are odd so the
sequence keeps its length):

=====================  ==================================================================
``attn{h}``            multi-head self-attention, ``h`` heads
``ffn{m}``             feed-forward, hidden width ``m * width``
``conv{k}``            1-D convolution over the sequence, kernel ``k``, then ReLU
``sepconv{k}``         depthwise convolution (kernel ``k``), pointwise convolution, ReLU
``lightconv{k}h{h}``   linear+GLU, lightweight convolution (Wu et al. 2019: a depthwise
                       kernel shared by the channels of each of ``h`` heads, softmax-
                       normalised over the kernel), linear
``glu``                gated linear unit: linear to 2*width, GLU
``identity``           the block is skipped
=====================  ==================================================================

``preset="naspipe"`` is NASPipe's space: its 24 candidates (:data:`NASPIPE_CANDIDATES`),
48 layers, width 1024 (layers and width may still be given). Building a graph creates only
:class:`~supernet.OpSpec` values, so even that space builds at once.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..builtin_ops import dropout
from ..errors import OpError, SupernetError
from ..graph import INPUT, SupernetGraph
from ..ops import OpContext, OpSpec, register_op
from . import check_float, check_input_shape, check_int, reject_unknown

__all__ = ["build", "candidate_spec", "DEFAULT_CANDIDATES", "NASPIPE_CANDIDATES"]

DEFAULT_CANDIDATES: tuple[str, ...] = ("attn2", "ffn2", "conv3", "identity")
NASPIPE_CANDIDATES: tuple[str, ...] = (
    "conv1", "conv3", "conv5",
    "sepconv3", "sepconv5", "sepconv7", "sepconv9", "sepconv11",
    *(f"lightconv{k}h{h}" for k in (3, 5, 7, 15) for h in (1, 4, 16)),
    "attn4", "attn8", "attn16",
    "glu",
)
_PRESETS = {"naspipe": {"candidates": NASPIPE_CANDIDATES, "layers": 48, "width": 1024}}
_OPTIONS = ("layers", "width", "candidates", "preset", "dropout")


def build(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    layers: int | None = None,
    width: int | None = None,
    candidates: Sequence[str] | None = None,
    preset: str | None = None,
    dropout: float = 0.0,
    **unknown: Any,
) -> SupernetGraph:
    """The transformer supernet graph. Without a preset: 4 layers, width 32, and candidates
    :data:`DEFAULT_CANDIDATES`; ``dropout`` applies to every block's output in training."""
    reject_unknown("transformer", unknown, ("input_shape", "num_classes", *_OPTIONS))
    if preset is not None and preset not in _PRESETS:
        raise SupernetError(f"transformer.preset: expected None or one of {sorted(_PRESETS)}, found {preset!r}")
    if preset is not None and candidates is not None:
        raise SupernetError(
            f"transformer.candidates: preset {preset!r} fixes the candidates, found both; "
            "drop the preset or the candidates"
        )
    defaults = _PRESETS[preset] if preset else {"candidates": DEFAULT_CANDIDATES, "layers": 4, "width": 32}
    layers = check_int("transformer", "layers", defaults["layers"] if layers is None else layers)
    width = check_int("transformer", "width", defaults["width"] if width is None else width)
    names = _check_candidates(defaults["candidates"] if candidates is None else candidates)
    p = check_float("transformer", "dropout", dropout, 0.0, 1.0)
    shape = check_input_shape("transformer", input_shape, (2, 3))
    num_classes = check_int("transformer", "num_classes", num_classes)

    cands = {name: candidate_spec(name, width, p) for name in names}
    g = SupernetGraph("transformer")
    prev = g.add_fixed("stem", OpSpec.of("tf_stem", in_shape=shape, width=width), [INPUT])
    digits = max(2, len(str(layers - 1)))
    for i in range(layers):
        prev = g.add_choice(f"layer{i:0{digits}d}", cands, [prev])
    g.add_fixed("head", OpSpec.of("tf_head", width=width, num_classes=num_classes), [prev])
    return g


def _check_candidates(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise SupernetError(f"transformer.candidates: expected a non-empty list of candidate names, found {value!r}")
    names = tuple(value)
    if len(set(names)) != len(names):
        raise SupernetError(f"transformer.candidates: expected distinct names, found {list(names)}")
    return names


# -- candidates ----------------------------------------------------------------------------
def candidate_spec(name: str, width: int, p: float = 0.0) -> OpSpec:
    """The op spec of candidate ``name`` (see the module docstring) at ``width``, dropout ``p``."""
    if name == "identity":
        return OpSpec.of("identity")
    if name == "glu":
        return OpSpec.of("tf_glu", width=width, p=p)
    for pattern, make in _PATTERNS:
        m = pattern.fullmatch(str(name))
        if m:
            return make(name, width, p, *(int(x) for x in m.groups()))
    raise SupernetError(
        f"transformer.candidates: unknown candidate {name!r}; expected one of the patterns "
        f"attn{{h}}, ffn{{m}}, conv{{k}}, sepconv{{k}}, lightconv{{k}}h{{h}}, glu, identity "
        f"(e.g. {', '.join(DEFAULT_CANDIDATES)})"
    )


def _heads(name: str, width: int, heads: int) -> int:
    if heads < 1 or width % heads:
        divisors = [d for d in range(1, min(width, 64) + 1) if width % d == 0]
        raise SupernetError(
            f"transformer.candidates: {name!r} has {heads} heads, which must divide width={width}; "
            f"heads that do: {divisors}{' ...' if width > 64 else ''}"
        )
    return heads


def _kernel(name: str, kernel: int) -> int:
    if kernel < 1 or kernel % 2 == 0:
        raise SupernetError(
            f"transformer.candidates: {name!r} has kernel {kernel}; expected an odd kernel "
            "so that the sequence keeps its length"
        )
    return kernel


def _positive(name: str, value: int, what: str) -> int:
    if value < 1:
        raise SupernetError(f"transformer.candidates: {name!r}: expected {what} >= 1, found {value}")
    return value


_Make = Callable[..., OpSpec]
_PATTERNS: tuple[tuple[re.Pattern[str], _Make], ...] = (
    (re.compile(r"attn(\d+)"), lambda n, w, p, h: OpSpec.of("tf_attn", width=w, heads=_heads(n, w, h), p=p)),
    (re.compile(r"ffn(\d+)"), lambda n, w, p, m: OpSpec.of("tf_ffn", width=w, mult=_positive(n, m, "mult"), p=p)),
    (re.compile(r"conv(\d+)"), lambda n, w, p, k: OpSpec.of("tf_conv", width=w, kernel=_kernel(n, k), p=p)),
    (re.compile(r"sepconv(\d+)"), lambda n, w, p, k: OpSpec.of("tf_sepconv", width=w, kernel=_kernel(n, k), p=p)),
    (
        re.compile(r"lightconv(\d+)h(\d+)"),
        lambda n, w, p, k, h: OpSpec.of("tf_lightconv", width=w, kernel=_kernel(n, k), heads=_heads(n, w, h), p=p),
    ),
)


# -- ops -----------------------------------------------------------------------------------
@register_op("tf_stem")
class Stem(nn.Module):
    """(batch, C, H, W) -> H tokens of C*W features, or (batch, L, F) as is; then linear to
    ``width`` plus a learned positional embedding: (batch, seq, width)."""

    def __init__(self, in_shape: tuple[int, ...], width: int) -> None:
        super().__init__()
        self.in_shape = tuple(in_shape)
        seq, feat = (in_shape[1], in_shape[0] * in_shape[2]) if len(in_shape) == 3 else in_shape
        self.proj = nn.Linear(feat, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.in_shape:
            raise OpError(
                f"op {ctx.op_id!r}: expected input of shape (batch, {', '.join(map(str, self.in_shape))}), "
                f"found {tuple(x.shape)}"
            )
        if x.dim() == 4:
            x = x.transpose(1, 2).flatten(2)  # (b, C, H, W) -> (b, H, C*W)
        return self.proj(x) + self.pos  # (b, seq, width)


@register_op("tf_head")
class Head(nn.Module):
    """(batch, seq, width) -> layernorm, mean over tokens, linear -> (batch, num_classes)."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class _Block(nn.Module):
    """A pre-norm residual block: ``x + dropout(body(LN(x)))``, (batch, seq, width) -> same."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.p = p

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *, ctx: OpContext) -> torch.Tensor:
        return x + dropout(self.body(self.norm(x)), self.p, ctx)


@register_op("tf_attn")
class Attention(_Block):
    """Multi-head self-attention with plain matmuls (no attention dropout: deterministic)."""

    def __init__(self, width: int, heads: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))  # (b, h, t, d/h) each
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (b, h, t, t)
        y = att.softmax(dim=-1) @ v  # (b, h, t, d/h)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


@register_op("tf_ffn")
class FeedForward(_Block):
    def __init__(self, width: int, mult: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.fc1 = nn.Linear(width, mult * width)
        self.fc2 = nn.Linear(mult * width, width)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@register_op("tf_conv")
class SeqConv(_Block):
    """A full 1-D convolution over the sequence, then ReLU."""

    def __init__(self, width: int, kernel: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.conv = nn.Conv1d(width, width, kernel, padding=kernel // 2)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)  # conv on (b, d, t)


@register_op("tf_sepconv")
class SepConv(_Block):
    """Depthwise convolution over the sequence, pointwise convolution, ReLU."""

    def __init__(self, width: int, kernel: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.depthwise = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=width)
        self.pointwise = nn.Conv1d(width, width, 1)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.pointwise(self.depthwise(x.transpose(1, 2)))).transpose(1, 2)


@register_op("tf_lightconv")
class LightConv(_Block):
    """Linear + GLU, lightweight convolution, linear (the block of Wu et al. 2019).

    The lightweight convolution is depthwise with ``heads`` kernels, softmax-normalised over
    the kernel; channel ``c`` uses kernel ``c % heads``, as fairseq's LightweightConv1d does.
    """

    def __init__(self, width: int, kernel: int, heads: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.heads = heads
        self.inp = nn.Linear(width, 2 * width)
        self.weight = nn.Parameter(torch.empty(heads, kernel))
        nn.init.xavier_uniform_(self.weight)
        self.out = nn.Linear(width, width)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = F.glu(self.inp(x), dim=-1)  # (b, t, d)
        d, k = x.shape[-1], self.weight.shape[1]
        w = self.weight.softmax(dim=-1).repeat(d // self.heads, 1).unsqueeze(1)  # (d, 1, k)
        y = F.conv1d(x.transpose(1, 2), w, padding=k // 2, groups=d)  # (b, d, t)
        return self.out(y.transpose(1, 2))


@register_op("tf_glu")
class GatedLinear(_Block):
    def __init__(self, width: int, p: float = 0.0) -> None:
        super().__init__(width, p)
        self.fc = nn.Linear(width, 2 * width)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return F.glu(self.fc(x), dim=-1)
