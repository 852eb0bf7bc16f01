"""Planners: which partition each step takes, given the subnet and where its ops sit now.

* :class:`DynamicPlanner` re-solves every subnet exactly (:func:`pipeline.plan.partition.solve`).
  Objective ``minmax``: the fewest moved bytes within ``(1 + eps)`` of the best slowest stage.
  Objective ``step`` (the default in the runtime): :func:`solve_step`, the near-optimal split
  whose replayed schedule plus the migration the step waits for (:func:`migration_wait`) is
  fastest.
* Baselines in the same terms: :class:`EqualCountPlanner`, :class:`StaticPlanner` (one split of
  the supernet's mean costs), :class:`OraclePlanner` (the optimum of every step, blind to
  migration). :func:`make_planner` builds any of them by name.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from .partition import (
    REL_SLACK, Partition, PartitionError, PartitionProblem, _fewest_moves_many, _grids, _infeasible,
    _make_partition, _minmax_dp, _tables, evaluate, random_problem, single_stage, solve, stage_work,
)
from .schedule import Schedule
from .simulate import makespan

__all__ = [
    "predicted_step", "solve_step", "STEP_GRID", "migration_wait", "equal_count", "static_bounds", "Planner",
    "DynamicPlanner", "EqualCountPlanner", "StaticPlanner", "OraclePlanner", "make_planner", "time_solve",
]


STEP_GRID = (0.0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.35, math.inf)  # inf: move as little as fits


def predicted_step(problem: PartitionProblem, part: Partition, move_seconds: float,
                   schedule: Schedule | None = None) -> float:
    """One step's predicted time plus the migration that precedes it. With ``schedule``: the
    schedule replayed with the partition's per-stage forward/backward sums and per-cut sends
    (:func:`pipeline.plan.simulate.makespan`). Without: every stage's work once (fill and drain)
    plus M - 1 more rounds of the slowest stage."""
    if schedule is None:
        return sum(part.stage_times) + (problem.num_microbatches - 1) * part.max_time + move_seconds
    return makespan(schedule, *stage_work(problem, part.bounds)) + move_seconds


def migration_wait(moved_bytes: float, moved_ops: int, busy_bytes: float, busy_ops: int,
                   bandwidth: float, latency: float, window: float = 0.0) -> float:
    """Seconds a step waits for the migration before it, as the runtime migrates.

    An op in use by the step before (``busy_*``: its bytes and count among the moved ones) can
    only move once that step has updated it, so its transfer is on the critical path. The others
    move during the step before (early migration) and delay this step only by what exceeds
    ``window``, that step's duration. ``busy_* == moved_*`` (or ``window = 0``) charges everything.
    """
    on_path = busy_bytes / bandwidth + latency * busy_ops
    ahead = (moved_bytes - busy_bytes) / bandwidth + latency * (moved_ops - busy_ops)
    return on_path + max(0.0, ahead - window)


def solve_step(problem: PartitionProblem, previous: Mapping[str, int] | None = None,
               move_bandwidth: float | None = None, move_latency: float | None = None,
               grid: Sequence[float] = STEP_GRID, schedule: Schedule | None = None,
               busy: AbstractSet[str] | None = None) -> Partition:
    """The memory-feasible partition that minimises :func:`predicted_step`, migration included.

    Migration is charged per moved op as ``latency + (param + optim bytes) / bandwidth`` (the
    problem's link unless given). With ``busy`` (the op ids the step before uses) it is charged
    as the runtime migrates (:func:`migration_wait`): the other ops move during that step, whose
    duration is taken to be this candidate's own step. The candidates are :func:`solve`'s choices
    for every ``eps`` of ``grid`` (``inf``: the split that moves least; with ``busy``, least of the
    busy ops' bytes first), scored by :func:`predicted_step` (with ``schedule``: the schedule
    replayed); the best wins, so it is never worse, by that measure, than :func:`solve` with any
    ``eps`` of the grid, nor than staying put where that fits.
    """
    bw = problem.bandwidth if move_bandwidth is None else move_bandwidth
    lat = problem.latency if move_latency is None else move_latency
    t = _tables(problem, previous, busy)
    N, P = problem.num_ops, problem.num_stages
    whole = single_stage(t, N)
    if whole is not None:
        return whole
    upper, T, moved, MEM = _grids(t, N)
    if busy is None:
        MV = [m.astype(float) for m in moved]
    else:  # the busy ops' bytes first (x 1024), then all bytes; integral, exact below 2**53
        MV = [(1024 * (t.busy_moved[s][None, :] - t.busy_moved[s][:, None]) + moved[s]).astype(float)
              for s in range(P)]
    optimum, _ = _minmax_dp(T)
    if not math.isfinite(optimum):
        raise _infeasible(problem, t, MEM, upper)
    stages = np.arange(P)

    def total(prefix: np.ndarray, bounds: tuple[int, ...]) -> int:  # a (P, N+1) prefix table over the split
        b = np.asarray(bounds)
        return int((prefix[stages, b[1:]] - prefix[stages, b[:-1]]).sum())

    best: tuple[float, tuple[int, ...]] | None = None
    scored: set[tuple[int, ...]] = set()
    thresholds = [math.inf if math.isinf(e) else (1.0 + e) * optimum * (1.0 + REL_SLACK) for e in grid]
    for bounds in _fewest_moves_many(T, MV, thresholds, N, P):
        if bounds in scored:
            continue
        scored.add(bounds)
        part = _make_partition(t, bounds)
        pipeline_s = predicted_step(problem, part, 0.0, schedule)
        wait = migration_wait(part.moved_bytes, total(t.moved_ops, bounds), total(t.busy_moved, bounds),
                              total(t.busy_moved_ops, bounds), bw, lat, window=pipeline_s if busy is not None else 0.0)
        score = pipeline_s + wait
        if best is None or score < best[0] * (1 - 1e-12):
            best = (score, bounds)
    return _make_partition(t, best[1])


# -------------------------------------------------------------------------------- baselines


def equal_count(problem: PartitionProblem, previous: Mapping[str, int] | None = None) -> Partition:
    """Equal op counts per stage, the remainder to the first stages; budgets are not consulted."""
    q, r = divmod(problem.num_ops, problem.num_stages)
    sizes = [q + (s < r) for s in range(problem.num_stages)]
    return evaluate(problem, (0, *np.cumsum(sizes).tolist()), previous)


def static_bounds(mean_problem: PartitionProblem) -> tuple[int, ...]:
    """The split :func:`solve` picks for the supernet's mean op costs, to reuse for every subnet."""
    return solve(mean_problem).bounds


class Planner(Protocol):
    """Chooses each step's partition given the subnet's problem and the current owners.

    ``busy``: the op ids the step before uses, when the runtime moves the other ops during that
    step (early migration); None when every move waits for the step. Only the dynamic planner's
    step objective weighs it."""

    name: ClassVar[str]

    def plan(self, problem: PartitionProblem, previous: Mapping[str, int] | None = None,
             busy: AbstractSet[str] | None = None) -> Partition: ...


@dataclass(frozen=True)
class DynamicPlanner:
    """Exact and migration-aware. ``objective="minmax"``: :func:`solve` with tolerance ``eps``
    (fewest moved bytes within ``(1 + eps)`` of the optimal slowest stage).
    ``objective="step"``: :func:`solve_step` over the tolerances of ``STEP_GRID`` up to ``eps``:
    among those choices, the one whose replayed schedule plus migration is fastest (``eps``
    still bounds how far from the best balance it may go; ``inf`` lets it stay put)."""

    eps: float = 0.0
    objective: str = "minmax"
    move_latency: float | None = None  # "step": fixed seconds per moved op (None: the link latency)
    name: ClassVar[str] = "dynamic"

    def __post_init__(self) -> None:
        if self.objective not in ("minmax", "step"):
            raise PartitionError(f"DynamicPlanner.objective: expected 'minmax' or 'step', found {self.objective!r}")

    def plan(self, problem: PartitionProblem, previous: Mapping[str, int] | None = None,
             busy: AbstractSet[str] | None = None) -> Partition:
        if self.objective == "step":
            grid = tuple(e for e in STEP_GRID if e < self.eps) + (self.eps,)
            return solve_step(problem, previous, move_latency=self.move_latency, grid=grid, busy=busy,
                              schedule=problem.schedule)
        return solve(problem, previous, self.eps)


@dataclass(frozen=True)
class EqualCountPlanner:
    """Equal op counts per stage."""

    name: ClassVar[str] = "equal"

    def plan(self, problem: PartitionProblem, previous: Mapping[str, int] | None = None,
             busy: AbstractSet[str] | None = None) -> Partition:
        return equal_count(problem, previous)


@dataclass(frozen=True)
class OraclePlanner:
    """The exact optimum of every step, blind to migration (moved bytes are still reported)."""

    name: ClassVar[str] = "oracle"

    def plan(self, problem: PartitionProblem, previous: Mapping[str, int] | None = None,
             busy: AbstractSet[str] | None = None) -> Partition:
        return evaluate(problem, solve(problem).bounds, previous)


@dataclass(frozen=True)
class StaticPlanner:
    """One split for every step: fixed ``bounds``, or per-stage op ``fractions`` scaled to N.

    Fixed bounds suit spaces whose subnets all have the same number of active ops (a chain
    space); use ``fractions`` when N varies. Build it from the supernet's mean costs with
    :meth:`from_problem`. Budgets are not consulted: check ``Partition.fits_memory``.
    """

    bounds: tuple[int, ...] | None = None
    fractions: tuple[float, ...] | None = None
    name: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        if (self.bounds is None) == (self.fractions is None):
            raise PartitionError("StaticPlanner: expected exactly one of bounds= or fractions=, "
                                 f"found bounds={self.bounds!r}, fractions={self.fractions!r}")
        if self.bounds is not None:
            object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        else:
            fr = tuple(float(f) for f in self.fractions)
            if not fr or any(not (math.isfinite(f) and f >= 0) for f in fr) or sum(fr) <= 0:
                raise PartitionError(f"StaticPlanner.fractions: expected one non-negative share per stage "
                                     f"with a positive sum, found {fr!r}")
            object.__setattr__(self, "fractions", fr)

    @classmethod
    def from_problem(cls, mean_problem: PartitionProblem) -> StaticPlanner:
        return cls(bounds=static_bounds(mean_problem))

    def bounds_for(self, problem: PartitionProblem) -> tuple[int, ...]:
        N, P = problem.num_ops, problem.num_stages
        if self.bounds is not None:
            if len(self.bounds) != P + 1 or self.bounds[-1] != N:
                raise PartitionError(
                    f"StaticPlanner.bounds: {self.bounds} were made for N={self.bounds[-1]} ops over "
                    f"{len(self.bounds) - 1} stages, found a problem with N={N}, P={P}. Hint: fixed bounds "
                    "only suit spaces with a constant op count; use fractions= otherwise")
            return self.bounds
        if len(self.fractions) != P:
            raise PartitionError(f"StaticPlanner.fractions: expected {P} shares (one per stage), "
                                 f"found {len(self.fractions)}")
        cum = np.cumsum(self.fractions) / sum(self.fractions)
        return (0, *(int(math.floor(c * N + 0.5)) for c in cum[:-1]), N)

    def plan(self, problem: PartitionProblem, previous: Mapping[str, int] | None = None,
             busy: AbstractSet[str] | None = None) -> Partition:
        return evaluate(problem, self.bounds_for(problem), previous)


_PLANNERS = {"dynamic": DynamicPlanner, "equal": EqualCountPlanner, "static": StaticPlanner,
             "oracle": OraclePlanner}


def make_planner(name: str, **kw: object) -> Planner:
    """Build a planner by name: ``dynamic`` (eps=), ``equal``, ``static`` (bounds= | fractions=), ``oracle``."""
    if name not in _PLANNERS:
        raise PartitionError(f"planner name: expected one of {sorted(_PLANNERS)}, found {name!r}")
    try:
        return _PLANNERS[name](**kw)
    except TypeError as e:
        raise PartitionError(f"planner {name!r}: bad options {sorted(kw)}: {e}") from None


def time_solve(num_ops: int = 50, num_stages: int = 8, num_microbatches: int = 8, eps: float = 0.05,
               repeats: int = 21, seed: int = 0) -> float:
    """Median seconds of one :func:`solve` on a random problem with a feasible budget and owners."""
    rng = np.random.default_rng(seed)
    loose = random_problem(rng, num_ops, num_stages, num_microbatches)
    ref = solve(loose)
    budget = (1.1 * max(ref.stage_memory),) * num_stages
    problem = PartitionProblem(loose.ops, loose.cut_bytes, num_stages, num_microbatches, loose.schedule,
                               loose.bandwidth, loose.latency, budget)
    previous = equal_count(problem).assignment([op.op_id for op in problem.ops])
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        solve(problem, previous, eps)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
