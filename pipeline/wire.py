"""What crosses every cut of a plan, derived without messages: shapes, dtypes and ``None``s.

Every rank knows the graph, the arch, the partition and the micro-batch's shape, so every rank
can work out each tensor that a schedule message carries: one dry run of the stages' slices on
the meta device (forward with the same executor, then backward from a gradient of the output's
shape) gives each stage's forward inputs and the gradients it receives, including the entries
that carry no gradient (``None``). A schedule message is then its payload alone. The result is
cached with the plan and made ahead in the planning thread.

An op that cannot run on the meta device makes :func:`wire_specs` return ``None``; the engine
then sends that plan's messages self-describing (shapes in a header), which is slower but
always right.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from supernet import Slice, SliceRun, op_contexts

__all__ = ["TensorSpec", "WireSpecs", "wire_specs", "MetaModules"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


Specs = tuple[TensorSpec | None, ...]


@dataclass(frozen=True)
class WireSpecs:
    """Per stage s: ``forward[s]``, the tensors stage s receives from s-1 in a forward action
    (``()`` for stage 0, which reads the data), and ``backward[s]``, the gradients stage s
    receives from s+1 in a backward action (``()`` for the last stage, which makes its own
    from the loss); ``None`` marks an entry that carries no gradient."""

    forward: tuple[Specs, ...]
    backward: tuple[Specs, ...]


class MetaModules:
    """Each op built once on the meta device (no memory, no seeding): the dry run's weights."""

    def __init__(self, build: Callable[[str], nn.Module]) -> None:
        self._build = build
        self._modules: dict[str, nn.Module] = {}

    def __call__(self, op_id: str) -> nn.Module:
        m = self._modules.get(op_id)
        if m is None:
            with torch.device("meta"):
                m = self._modules[op_id] = self._build(op_id)
        return m


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec(tuple(t.shape), t.dtype)


def wire_specs(slices: Sequence[Slice], modules: MetaModules, sample_shape: Sequence[int], dtype: torch.dtype,
               seed: int) -> WireSpecs | None:
    """The dry run: ``sample_shape`` is one micro-batch's input shape (batch dimension first)."""
    try:
        x = torch.empty(tuple(sample_shape), dtype=dtype, device="meta")
        runs, forward = [], [()]
        inputs: list[torch.Tensor] = [x]
        for s, sl in enumerate(slices):
            run = SliceRun(sl, modules, op_contexts(seed, 0, 0, True))
            outs = run.forward(inputs)
            runs.append(run)
            if s + 1 < len(slices):
                forward.append(tuple(_spec(t) for t in outs))
                inputs = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outs]
        backward: list[Specs] = [()] * len(slices)
        grads: list[torch.Tensor | None] = [torch.empty(outs[0].shape, dtype=outs[0].dtype, device="meta")]
        for s in range(len(slices) - 1, 0, -1):
            got = runs[s].backward(grads)
            backward[s - 1] = tuple(_spec(g) for g in got)
            grads = [None if g is None else torch.empty(g.shape, dtype=g.dtype, device="meta") for g in got]
        return WireSpecs(tuple(forward), tuple(backward))
    except Exception as e:  # an op without a meta kernel: fall back to self-describing messages
        log.warning("shape inference on the meta device failed (%s); messages of this plan carry their shapes", e)
        return None
