"""What combines with what: the one table of the limits that remain, checked before any rank starts.

Every combination of ``pipeline.window`` >= 1, ``pipeline.shared_ops`` exact / delayed / frozen,
replicated stages (R >= 1) and a tensor-manager budget (``memory.device_budget_bytes`` or
``device_budget_fraction``, every policy, optimizer placement and activation mode) runs through
the one stage executor (:mod:`pipeline.executor`) and computes the one-process run's bits. What
does not combine is listed here, once, as data; :func:`check` raises the first row that applies
as one line naming the fields, what was found and what to set instead. The app calls it when it
reads the config (every rank, before anything is written); the engine calls it again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .memory import MemorySettings
from .settings import PipelineSettings

__all__ = ["CombinationError", "Limit", "LIMITS", "check", "limits_table"]


class CombinationError(ValueError):
    """Settings that do not (yet) combine."""


@dataclass(frozen=True)
class Run:
    """What the table reads of a run's settings."""

    pipeline: PipelineSettings
    memory: MemorySettings
    clip_grad_norm: float | None = None
    world_size: int = 1  # the processes (torchrun's WORLD_SIZE)


@dataclass(frozen=True)
class Limit:
    """One row: the fields, when the row applies, why, and what to set instead."""

    fields: str
    applies: Callable[[Run], bool]
    found: Callable[[Run], str]
    why: str
    instead: str


LIMITS: tuple[Limit, ...] = (
    Limit("train.clip_grad_norm / pipeline.delay_compensation",
          lambda r: (r.clip_grad_norm is not None and r.pipeline.shared_ops == "delayed" and r.world_size > 1
                     and r.pipeline.delay_compensation == "dc"),
          lambda r: "delay_compensation 'dc' with clipping in a pipeline",
          "each stage sends its gradients' norm after its last backward of a subnet, and 'dc' changes a delayed "
          "op's gradient only at its update",
          "set pipeline.delay_compensation=predict or none"),
    Limit("pipeline.memory_budget_bytes / memory.device_budget_bytes",
          lambda r: r.memory.virtual and r.pipeline.memory_budget_bytes is not None,
          lambda r: f"pipeline.memory_budget_bytes {r.pipeline.memory_budget_bytes!r} beside a tensor-manager budget",
          "the manager's arena bounds each stage's split",
          "set pipeline.memory_budget_bytes=null"),
    Limit("pipeline.inflight / pipeline.memory_budget_bytes, memory.activation_budget_bytes",
          lambda r: r.pipeline.inflight == "bytes" and (r.pipeline.memory_budget_bytes is not None
                                                        or r.memory.activation_budget_bytes is not None),
          lambda r: "inflight 'bytes' with " + ("pipeline.memory_budget_bytes"
                                                if r.pipeline.memory_budget_bytes is not None
                                                else "memory.activation_budget_bytes"),
          "those budgets check each subnet's split or activation plan with the count cap's micro-batches of that "
          "subnet, and the byte cap lets a stage hold more of a lighter one (a tensor-manager budget bounds the "
          "weights' arena, beside the activations: that combines)",
          "set pipeline.inflight=count"),
)


def check(pipeline: PipelineSettings, memory: MemorySettings | None, clip_grad_norm: float | None = None,
          world_size: int = 1) -> None:
    """Raise :class:`CombinationError` for the first row of :data:`LIMITS` that applies
    (``world_size``: the processes the run has)."""
    run = Run(pipeline, memory if memory is not None else MemorySettings(), clip_grad_norm, world_size)
    for limit in LIMITS:
        if limit.applies(run):
            raise CombinationError(f"{limit.fields}: found {limit.found(run)}, which do not combine: {limit.why}; "
                                   f"{limit.instead}")


def limits_table() -> str:
    """The table as Markdown (the README's copy is checked against it)."""
    rows = ["| settings | why they do not combine | instead |", "|---|---|---|"]
    rows += [f"| `{lim.fields}` | {lim.why} | {lim.instead} |" for lim in LIMITS]
    return "\n".join(rows)
