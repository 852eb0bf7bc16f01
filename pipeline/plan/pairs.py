"""BPipe's pairing of pipeline stages: who hands saved activations to whom, and planning a pair together.

Under 1F1B stage ``s`` holds ``P - s`` micro-batches of activations, so the first stages run out
of memory while the last have room. BPipe pairs stage ``s`` with stage ``P - 1 - s`` (the sum of
their micro-batches in flight is ``P + 1`` for every pair): the earlier one *gives* (the peer
choice of :mod:`pipeline.plan.activations`), the later one *holds*, and the middle stage of an
odd ``P`` is its own pair (neither). :func:`pair_plans` plans every stage, a holder before its
giver: what the holder's budget leaves is what its giver may hand it, and the holder's plan
counts it (``held_for_pair``). Pure: values in, values out.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from .activations import CHOICES, PEER, ActivationError, ActivationPlan, stage_activation_plan
from .partition import PartitionProblem

__all__ = ["pair_of", "gives", "pair_plans", "stage_activation_plans"]


def pair_of(stage: int, num_stages: int) -> int:
    """The stage ``stage`` is paired with (BPipe): ``P - 1 - stage`` (the middle stage of an odd
    ``P`` is its own pair and neither gives nor holds)."""
    return num_stages - 1 - stage


def gives(stage: int, num_stages: int) -> bool:
    """Whether ``stage`` may hand activations to its pair: the earlier stage of a pair (under
    1F1B it holds more micro-batches in flight)."""
    return stage < pair_of(stage, num_stages)


def pair_plans(num_stages: int, budgets: Sequence[float], allowed: Sequence[str],
               plan: Callable[[int, tuple[str, ...], float], ActivationPlan]) -> tuple[ActivationPlan, ...]:
    """Every stage's plan, the pairs planned together: ``plan(stage, allowed, peer_capacity)``
    plans one stage. Without ``peer`` in ``allowed`` each stage alone. With it, each holder (the
    later stage of a pair, and an odd ``P``'s middle stage) first, with no peer; what its budget
    leaves (``budgets[holder] - memory``) is its giver's ``peer_capacity``; the holder's
    ``held_for_pair`` is what its giver's plan puts there."""
    P = num_stages
    if len(budgets) != P:
        raise ActivationError(f"budgets: expected {P} values (one per stage), found {len(budgets)}")
    own = tuple(c for c in allowed if c != PEER)
    plans: list[ActivationPlan | None] = [None] * P
    for s in range(P):
        if not gives(s, P) or PEER not in allowed:
            plans[s] = plan(s, own, 0.0)
    if PEER in allowed:
        for s in range(P):
            if gives(s, P):
                r = pair_of(s, P)
                plans[s] = plan(s, tuple(allowed), max(0.0, float(budgets[r]) - plans[r].memory))
                plans[r] = dataclasses.replace(plans[r], held_for_pair=plans[s].peer_held)
    return tuple(plans)


def stage_activation_plans(problem: PartitionProblem, bounds: Sequence[int], budgets: Sequence[float],
                           host_bandwidth: float = math.inf, allowed: Sequence[str] = CHOICES,
                           peer_bandwidth: float = math.inf) -> tuple[ActivationPlan, ...]:
    """:func:`stage_activation_plan` of every stage against ``budgets`` (per stage), paired by
    :func:`pair_plans` when ``peer`` is allowed."""
    return pair_plans(problem.num_stages, budgets, allowed, lambda s, allow, capacity: stage_activation_plan(
        problem, bounds, s, float(budgets[s]), host_bandwidth, 0.0, allow, peer_capacity=capacity,
        peer_bandwidth=peer_bandwidth))
