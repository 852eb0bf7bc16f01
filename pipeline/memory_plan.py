"""What the memory settings mean to planning: the partitioner's model of each stage's device
arena, and each stage's keep/swap/recompute choice per op.

With a device budget (``memory.device_budget_bytes``) a stage's ops live in host memory and
only the ops of the step (and what is fetched ahead) sit in its arena, so a split fits when
every stage's active ops fit its arena (:class:`~pipeline.plan.partition.ManagedMemory` with
the exact bytes each op takes there); inactive ops count nowhere. ``memory.activations=auto``
chooses, per stage of each plan, which ops keep their saved activations, swap them to host
memory or recompute them, so the activations the schedule keeps fit ``memory.
activation_budget_bytes`` at the least added time (:func:`pipeline.plan.activations.
stage_activation_plan`). Both are pure functions of the plan's problem: every rank makes the
same choice, ahead of the step, with the partition.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .memory import MemoryBudgetError
from .memory_settings import MemorySettings
from .plan.activations import ActivationError, stage_activation_plan
from .plan.partition import ManagedMemory, Partition, PartitionProblem

__all__ = ["MemoryModel", "check_fits", "arena_error"]


@dataclass(frozen=True)
class MemoryModel:
    """The planner's view of ``memory`` for ``num_stages`` stages.

    ``arena_bytes``: each stage's arena capacity (None: no budget, every op resident);
    ``footprint``: op id -> bytes it takes in an arena (``TensorManager.footprint``)."""

    settings: MemorySettings
    arena_bytes: tuple[int, ...] | None = None
    footprint: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if (self.arena_bytes is None) != (self.footprint is None):
            raise ValueError("MemoryModel: arena_bytes and footprint go together (both or neither)")

    @property
    def managed(self) -> ManagedMemory | None:
        """The partitioner's memory model (None without a budget)."""
        if self.arena_bytes is None:
            return None
        return ManagedMemory(self.settings.optimizer, arena=self.footprint)

    def budgets(self) -> tuple[float, ...] | None:
        return None if self.arena_bytes is None else tuple(float(b) for b in self.arena_bytes)

    def activation_choices(self, problem: PartitionProblem,
                           bounds: Sequence[int]) -> tuple[Mapping[str, str], ...] | None:
        """Per stage, op id -> ``keep`` | ``swap`` | ``recompute`` under ``memory.activations``
        (None: every op keeps, the default). ``auto`` plans each stage against ``memory.
        activation_budget_bytes``; a stage no plan fits raises naming that field and the shortfall."""
        mode = self.settings.activations
        if mode == "keep":
            return None
        P = problem.num_stages
        if mode != "auto":
            return tuple({op.op_id: mode for op in problem.ops[bounds[s]:bounds[s + 1]]} for s in range(P))
        budget = self.settings.activation_budget_bytes
        choices = []
        for s in range(P):
            try:
                plan = stage_activation_plan(problem, bounds, s, math.inf if budget is None else float(budget),
                                             self.settings.host_link_bandwidth)
            except ActivationError as e:
                raise ActivationError(f"memory.activation_budget_bytes: stage {s} of the split {tuple(bounds)} "
                                      f"cannot keep its activations within {budget} bytes: {e}",
                                      short_by=e.short_by) from None
            choices.append(plan.choice())
        return tuple(choices)


def check_fits(model: MemoryModel, part: Partition, what: str) -> None:
    """Raise when a split made without the arena's bound (a static planner's) overflows it."""
    if model.arena_bytes is not None and not part.fits_memory:
        raise arena_error(model, part, what)


def arena_error(model: MemoryModel, part: Partition, what: str) -> MemoryBudgetError:
    """The error for a split that overflows a stage's arena: where, by how much, and what helps."""
    over = [m - b for m, b in zip(part.stage_memory, model.arena_bytes)]
    s = max(range(len(over)), key=over.__getitem__)
    need, arena = part.stage_memory[s], model.arena_bytes[s]
    hint = "" if model.settings.optimizer == "host" else ", or keep the optimizer state on the host (memory.optimizer=host)"
    return MemoryBudgetError(
        f"memory.device_budget_bytes: {what}, bounds {part.bounds}, needs {need} bytes of weights, buffers and "
        f"optimizer state for the active ops of stage {s}, but its arena is {arena} bytes: short by {need - arena} "
        f"bytes; raise memory.device_budget_bytes by at least that, use more stages{hint}", need, arena)
