"""The memory budgets' errors: what must be resident at once does not fit the device budget, or
the activations a run trains with do not fit the activation budget.

Every check that compares bytes against ``memory.device_budget_bytes`` (the store's, when an op
or a step's ops are placed; the reference engine's and the app's pre-check, for the largest
subnet; the planner's, for a stage's share of a split) raises the error built here, so the field,
the shortfall and the hint read the same wherever the budget is short; the pre-check of
``memory.activation_budget_bytes`` (:mod:`.feasibility`) raises :func:`activation_budget_error`.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..plan.activations import ActivationError

__all__ = ["MemoryBudgetError", "budget_error", "fragmented_error", "activation_budget_error"]

_MIB = float(2**20)


class MemoryBudgetError(ValueError):
    """The device budget cannot hold what must be resident at once."""

    def __init__(self, message: str, needed: int, budget: int) -> None:
        super().__init__(message)
        self.needed, self.budget = needed, budget
        self.short_by = needed - budget


def budget_error(what: str, needed: int, budget: int, hints: Sequence[str] = ()) -> MemoryBudgetError:
    """``what`` (a noun phrase: the ops that must be resident at once) takes ``needed`` bytes of
    op state, over a budget of ``budget`` bytes (per process: per stage in a pipeline);
    ``hints``: other ways out than a larger budget."""
    ways = ", or ".join((f"raise memory.device_budget_bytes to at least {needed}", *hints))
    return MemoryBudgetError(
        f"memory.device_budget_bytes: {what}: {needed} bytes ({needed / _MIB:.2f} MiB) of weights, buffers and "
        f"optimizer state must be resident at once, but the budget is {budget} bytes ({budget / _MIB:.2f} MiB): "
        f"short by {needed - budget} bytes; {ways}", needed, budget)


def fragmented_error(op_id: str, nbytes: int, free: int, in_use: int, pinned: int, budget: int) -> MemoryBudgetError:
    """No region for ``op_id`` although the step's ops fit the budget: the free bytes are split
    around ops already handed out this step (they cannot move: autograd holds views of them)."""
    return MemoryBudgetError(
        f"memory.device_budget_bytes: no region of {nbytes} bytes for op {op_id!r}: {free} bytes are free but split "
        f"around {in_use} ops already in use this step (the step's ops take {pinned} bytes of a budget of "
        f"{budget}); ensure() a step's ops before using any of them, or raise memory.device_budget_bytes",
        pinned, budget)


def activation_budget_error(what: str, needed: int, budget: int, hints: Sequence[str] = ()) -> ActivationError:
    """``what`` (a noun phrase: the activations of a subnet on a stage) needs ``needed`` bytes
    with every op at its smallest choice, over ``memory.activation_budget_bytes`` = ``budget``;
    ``hints``: other ways out than a larger budget."""
    ways = ", or ".join((f"raise memory.activation_budget_bytes to {needed} or more", *hints))
    return ActivationError(
        f"memory.activation_budget_bytes: expected at least {needed} bytes ({needed / _MIB:.2f} MiB): {what} need "
        f"that much with every op at its smallest choice of keep, swap and recompute; found {budget} "
        f"({budget / _MIB:.2f} MiB), short by {needed - budget} bytes; {ways}", short_by=needed - budget)
