"""Sizing: the bytes each op takes in a device arena, and what the settings mean to planning.

:func:`footprints` sizes ops from their specs (a meta build, no real weights): the aligned
layout of weights, buffers and, unless the optimizer runs on the host, optimizer state; the
tensor manager, the engines' start-up check and the benches all ask it.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from supernet import Arch, OpSpec, SupernetGraph, build_op

from ..plan.activations import ALL_CHOICES, CHOICES, ActivationError, stage_activation_floor, stage_activation_plan
from ..plan.pairs import gives, pair_plans
from ..plan.partition import ManagedMemory, Partition, PartitionProblem
from .errors import MemoryBudgetError, budget_error
from .optim import OptimConfig
from .settings import MemorySettings
from .state import alignment_for, op_layout, optim_state_keys

__all__ = ["footprints", "op_footprints", "largest_subnet_footprint", "largest_subnet", "check_largest_subnet",
           "MemoryModel", "check_fits", "arena_error"]


def footprints(spec_of: Callable[[str], OpSpec], op_ids: Iterable[str], seed: int, state_keys: Sequence[str],
               align: int, optim_on_host: bool) -> dict[str, int]:
    """Per op, the bytes it takes in an arena (aligned weights, buffers and, unless
    ``optim_on_host``, optimizer state), from its spec without building real weights."""
    out = {}
    for op_id in op_ids:
        with torch.device("meta"):
            module = build_op(spec_of(op_id), op_id, seed, seeded=False)
        layout = op_layout(module, state_keys, align)
        out[op_id] = layout.weights_nbytes if optim_on_host else layout.nbytes
    return out


def op_footprints(graph: SupernetGraph, seed: int, optim: OptimConfig, device: torch.device, memory: MemorySettings,
                  op_ids: Iterable[str] | None = None) -> dict[str, int]:
    """:func:`footprints` of ``graph``'s ops (default: all) as a :class:`~.manager.TensorManager`
    of these settings on ``device`` counts them (its optimizer's state keys, the device's
    alignment, whether state can stay home), without building one."""
    specs = {slot.op_id: slot.spec for slot in graph.slots()}
    return footprints(specs.__getitem__, specs if op_ids is None else op_ids, seed,
                      optim_state_keys(optim.name, optim.momentum), alignment_for(device), memory.state_can_stay_home)


def largest_subnet(graph: SupernetGraph, sizes: Mapping[str, int]) -> Arch:
    """The subnet whose every choice slot takes its candidate of most arena bytes (the first
    such, in candidate order): every subnet runs one op per node, and none is larger at any node."""
    best: dict[str, tuple[int, str]] = {}
    for slot in graph.slots():
        if graph.is_choice(slot.node) and sizes[slot.op_id] > best.get(slot.node, (-1, ""))[0]:
            best[slot.node] = (sizes[slot.op_id], slot.op_id[len(slot.node) + 1:])  # "<slot>/<candidate>"
    return Arch({node: cand for node, (_, cand) in best.items()})


def largest_subnet_footprint(graph: SupernetGraph, sizes: Mapping[str, int]) -> int:
    """Bytes the largest subnet takes in the arena: every slot's biggest candidate, and the
    fixed ops (the least budget with which any subnet of the supernet can run in one process)."""
    by_node: dict[str, int] = {}
    for slot in graph.slots():
        by_node[slot.node] = max(by_node.get(slot.node, 0), sizes[slot.op_id])
    return sum(by_node.values())


def check_largest_subnet(graph: SupernetGraph, sizes: Mapping[str, int], budget: int) -> None:
    """One process: the largest subnet (:func:`largest_subnet`) must fit ``budget`` bytes of
    arena, since the search may train or score any subnet; else the budget's error."""
    need = largest_subnet_footprint(graph, sizes)
    if need > budget:
        raise budget_error(f"the largest subnet of {graph.name!r} (the search may train or score any), "
                           f"{largest_subnet(graph, sizes).to_json()}", need, budget)


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
        return ManagedMemory("host" if self.settings.state_can_stay_home else "device", arena=self.footprint)

    def budgets(self) -> tuple[float, ...] | None:
        return None if self.arena_bytes is None else tuple(float(b) for b in self.arena_bytes)

    def activation_floors(self, problem: PartitionProblem, bounds: Sequence[int]) -> tuple[int, ...]:
        """Per stage, the least bytes of activations any ``auto`` plan keeps (every op at its
        smallest choice): :meth:`activation_choices` raises exactly when a stage's exceeds
        ``memory.activation_budget_bytes``."""
        return tuple(stage_activation_floor(problem, bounds, s) for s in range(problem.num_stages))

    def activation_choices(self, problem: PartitionProblem,
                           bounds: Sequence[int]) -> tuple[Mapping[str, str], ...] | None:
        """Per stage, op id -> ``keep`` | ``swap`` | ``recompute`` | ``peer`` under ``memory.
        activations`` (None: every op keeps, the default). ``peer``: every op of a giving stage
        (the earlier of each pair) goes to its pair, the others keep. ``auto`` plans each stage
        against ``memory.activation_budget_bytes``, pairs together (a holder first, its room left
        its giver's: :func:`~pipeline.plan.pairs.pair_plans`); a stage no plan fits raises
        naming that field and the shortfall."""
        mode = self.settings.activations
        if mode == "keep":
            return None
        P = problem.num_stages
        if mode == "peer":
            return tuple({op.op_id: "peer" if gives(s, P) else "keep" for op in problem.ops[bounds[s]:bounds[s + 1]]}
                         for s in range(P))
        if mode != "auto":
            return tuple({op.op_id: mode for op in problem.ops[bounds[s]:bounds[s + 1]]} for s in range(P))
        budget = self.settings.activation_budget_bytes
        limit = math.inf if budget is None else float(budget)

        def plan(s: int, allowed: tuple[str, ...], capacity: float):
            try:
                return stage_activation_plan(problem, bounds, s, limit, self.settings.host_link_bandwidth,
                                             allowed=allowed, peer_capacity=capacity,
                                             peer_bandwidth=self.settings.peer_link_bandwidth)
            except ActivationError as e:
                raise ActivationError(f"memory.activation_budget_bytes: stage {s} of the split {tuple(bounds)} "
                                      f"cannot keep its activations within {budget} bytes: {e}",
                                      short_by=e.short_by) from None

        plans = pair_plans(P, (limit,) * P, ALL_CHOICES if P > 1 else CHOICES, plan)
        return tuple(p.choice() for p in plans)


def check_fits(model: MemoryModel, part: Partition, what: str) -> None:
    """Raise when a split made without the arena's bound (a static planner's) overflows it."""
    if model.arena_bytes is not None and not part.fits_memory:
        raise arena_error(model, part, what)


def arena_error(model: MemoryModel, part: Partition, what: str) -> MemoryBudgetError:
    """The error for a split that overflows a stage's arena: where, by how much, and what helps."""
    over = [m - b for m, b in zip(part.stage_memory, model.arena_bytes)]
    s = max(range(len(over)), key=over.__getitem__)
    hints = ["use more stages"]
    if not model.settings.state_can_stay_home:
        hints.append("keep the optimizer state on the host (memory.optimizer=host)")
    return budget_error(f"{what}, bounds {part.bounds}, the active ops of stage {s}",
                        int(part.stage_memory[s]), int(model.arena_bytes[s]), hints)
