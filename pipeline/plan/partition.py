"""The stage partitioner: where to cut a subnet's active ops into P contiguous pipeline stages.

Stage ``s`` holding ops ``[i, j)`` (``i == j`` is an empty stage, which still relays its input)
costs, per micro-batch (see :func:`stage_cost`, the one place this formula lives)::

    time(s)   = sum(fwd + bwd of ops i..j-1)
              + comm(i) if s > 0        # receive the activation, send its gradient back
              + comm(j) if s < P - 1    # send the activation on, receive its gradient
    comm(c)   = 2 * (latency + cut_bytes[c] / bandwidth)
    memory(s) = sum(param + optim bytes of ops i..j-1)
              + in_flight(s) * (sum(act_bytes of ops i..j-1) + cut_bytes[i])

``in_flight`` is ``PartitionProblem.in_flight``: what the problem's schedule object holds at its
peak (``min(M, P - s)`` for 1F1B, ``M`` for GPipe), or a bound given with it (cross-subnet
schedules, :func:`pipeline.plan.admission.in_flight_bound`); ``cut_bytes[i]`` is the stage's
received input, kept for every micro-batch in flight.

With the virtualized tensor manager (``PartitionProblem.memory``, a :class:`ManagedMemory`) the
device holds only what the manager keeps resident, so memory(s) counts the stage's active ops'
weights + grads (+ optimizer state when it lives on the device), the activations (all kept, or
with ``activations="auto"`` the least the keep/swap/recompute plan of
:mod:`pipeline.plan.activations` reaches with every op at its smallest choice) and a ``reserve``
for the ops being prefetched; inactive ops live in host memory and count nowhere. With an
``arena`` (the exact bytes each op takes in the manager's device arena, what the engines pass)
the budget is the arena's: memory(s) = the stage's ops' arena bytes + reserve, gradients and
activations living outside it (``memory.activation_budget_bytes`` bounds the activations kept,
planned per stage by :func:`pipeline.plan.activations.stage_activation_plan`). Without a
manager (the default) the formula above holds unchanged.
Comm is charged by stage position, so ``cut_bytes[0]`` only costs time when stage 0 is empty
and has to relay the input.

:func:`solve` is exact: a min-max DP over (stage, boundary) gives the smallest achievable
slowest-stage time under the memory budgets; a second DP then picks, among all partitions
within ``(1 + eps)`` of it, the one that moves the fewest parameter+optimizer bytes away from
the stages that own them now, then the fastest, then the lexicographically smallest bounds.
Which partition each step takes (the planners, the step objective, the baselines) is
:mod:`pipeline.plan.planners`; they all price a split with :func:`evaluate`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np

from .schedule import SCHEDULES, Schedule, build as build_schedule, max_in_flight

__all__ = [
    "OpCost", "ManagedMemory", "PartitionProblem", "Partition", "PartitionError", "stage_cost", "solve", "evaluate",
    "stage_work", "kept_per_microbatch", "random_problem", "REL_SLACK",
]

REL_SLACK = 1e-12  # relative slack on the (1 + eps) * optimum threshold: the optimum always passes
_MIB = float(2**20)


class PartitionError(ValueError):
    """A partition problem is malformed or cannot fit its memory budgets."""

    def __init__(self, message: str, short_by: float | None = None, stage: int | None = None,
                 closest: Partition | None = None) -> None:
        super().__init__(message)
        self.short_by = short_by  # bytes over budget on the tightest stage of the best partition
        self.stage = stage
        self.closest = closest  # that partition


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_bytes(field: str, v: object) -> int:
    if not _is_int(v) or v < 0:
        raise PartitionError(f"{field}: expected a non-negative int (bytes), found {v!r}")
    return int(v)


def _check_seconds(field: str, v: object) -> float:
    if not isinstance(v, (int, float, np.floating)) or not (math.isfinite(v) and v >= 0):
        raise PartitionError(f"{field}: expected a finite non-negative number of seconds, found {v!r}")
    return float(v)


@dataclass(frozen=True)
class OpCost:
    """One active op's per-micro-batch times (s) and bytes; ``act_bytes`` is kept for backward."""

    op_id: str
    fwd: float
    bwd: float
    param_bytes: int
    optim_bytes: int
    act_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.op_id, str) or not self.op_id:
            raise PartitionError(f"OpCost.op_id: expected a non-empty string, found {self.op_id!r}")
        for name in ("fwd", "bwd"):
            object.__setattr__(self, name, _check_seconds(f"OpCost({self.op_id!r}).{name}", getattr(self, name)))
        for name in ("param_bytes", "optim_bytes", "act_bytes"):
            object.__setattr__(self, name, _check_bytes(f"OpCost({self.op_id!r}).{name}", getattr(self, name)))


@dataclass(frozen=True)
class ManagedMemory:
    """The tensor manager's device memory model for the partitioner (see the module doc).

    ``optimizer``: ``"device"`` (the op's optimizer state travels with it and is updated on the
    device: weights + grads + ``optim_bytes`` resident per active op) or ``"host"`` (the state stays
    in host memory and the update runs there: weights + grads). ``activations``: ``"keep"`` (every
    saved activation stays, as without a manager) or ``"auto"`` (counted at the least any
    activation plan reaches: the plan itself, with its added time, is made per stage after the
    split by :func:`pipeline.plan.activations.partition_activation_plans`). ``reserve``: bytes per
    stage kept free for the ops being fetched ahead (one number for every stage, or one per stage).
    ``arena``: op id -> the bytes the op takes in the tensor manager's device arena (aligned
    weights, buffers and, with ``optimizer="device"``, optimizer state; ``TensorManager.
    footprint``); when given, a stage's memory is its ops' arena bytes + ``reserve`` alone.
    """

    optimizer: str = "device"
    activations: str = "keep"
    reserve: float | tuple[float, ...] = 0.0
    arena: Mapping[str, int] | None = field(default=None, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.optimizer not in ("device", "host"):
            raise PartitionError(f"ManagedMemory.optimizer: expected 'device' or 'host', found {self.optimizer!r}")
        if self.activations not in ("keep", "auto"):
            raise PartitionError(f"ManagedMemory.activations: expected 'keep' or 'auto', found {self.activations!r}")
        reserve = self.reserve if isinstance(self.reserve, tuple) else (self.reserve,)
        for v in reserve:
            if not (isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(v) and v >= 0):
                raise PartitionError(f"ManagedMemory.reserve: expected non-negative bytes, found {self.reserve!r}")
        for op_id, v in (self.arena or {}).items():
            if not _is_int(v) or v < 0:
                raise PartitionError(f"ManagedMemory.arena[{op_id!r}]: expected non-negative bytes (int), found {v!r}")

    def reserves(self, num_stages: int) -> tuple[float, ...]:
        if isinstance(self.reserve, tuple):
            if len(self.reserve) != num_stages:
                raise PartitionError(f"ManagedMemory.reserve: expected {num_stages} values (one per stage) or one "
                                     f"number, found {len(self.reserve)}")
            return tuple(float(v) for v in self.reserve)
        return (float(self.reserve),) * num_stages

    def state_bytes(self, op: OpCost) -> int:
        """Device bytes of one active op's state: weights, grads (same size) and, on the device, its
        optimizer state; with an ``arena``, the op's bytes there."""
        if self.arena is not None:
            try:
                return int(self.arena[op.op_id])
            except KeyError:
                raise PartitionError(f"ManagedMemory.arena: expected the arena bytes of every op, found none for "
                                     f"{op.op_id!r}") from None
        return 2 * op.param_bytes + (op.optim_bytes if self.optimizer == "device" else 0)


@dataclass(frozen=True)
class PartitionProblem:
    """A subnet's active ops (topological order) to split over ``num_stages`` stages.

    ``cut_bytes[i]`` is the per-micro-batch size of everything live across a boundary just
    before op ``i`` (``N + 1`` values). ``memory_budget`` is per stage, or None for unlimited.
    ``schedule``: the step's :class:`~pipeline.plan.schedule.Schedule` (a builder's name is
    built into one here, for callers that have none); ``in_flight``: per stage, the most
    micro-batches whose activations are held (default: the schedule's peak).
    ``memory``: the tensor manager's memory model (None: every op's state and every activation
    counts, as without a manager).
    """

    ops: tuple[OpCost, ...]
    cut_bytes: tuple[int, ...]
    num_stages: int
    num_microbatches: int
    schedule: Schedule | str = "1f1b"
    bandwidth: float = math.inf
    latency: float = 0.0
    memory_budget: tuple[float, ...] | None = None
    memory: ManagedMemory | None = None
    in_flight: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        for k, op in enumerate(ops):
            if not isinstance(op, OpCost):
                raise PartitionError(f"PartitionProblem.ops[{k}]: expected an OpCost, found {op!r}")
        ids = [op.op_id for op in ops]
        if len(set(ids)) != len(ids):
            dup = sorted({x for x in ids if ids.count(x) > 1})
            raise PartitionError(f"PartitionProblem.ops: op ids must be unique, found duplicates {dup}")
        cuts = tuple(_check_bytes(f"PartitionProblem.cut_bytes[{k}]", c) for k, c in enumerate(self.cut_bytes))
        object.__setattr__(self, "cut_bytes", cuts)
        if len(cuts) != len(ops) + 1:
            raise PartitionError(f"PartitionProblem.cut_bytes: expected N + 1 = {len(ops) + 1} values (one per "
                                 f"boundary, ops included at both ends), found {len(cuts)}")
        for name in ("num_stages", "num_microbatches"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise PartitionError(f"PartitionProblem.{name}: expected a positive int, found {v!r}")
        if isinstance(self.schedule, str):
            if self.schedule not in SCHEDULES:
                raise PartitionError(f"PartitionProblem.schedule: expected a Schedule or one of {sorted(SCHEDULES)}, "
                                     f"found {self.schedule!r}")
            object.__setattr__(self, "schedule", build_schedule(self.schedule, self.num_stages, self.num_microbatches))
        if not isinstance(self.schedule, Schedule) or (self.schedule.num_stages, self.schedule.num_microbatches) != (
                self.num_stages, self.num_microbatches):
            raise PartitionError(f"PartitionProblem.schedule: expected a Schedule of {self.num_stages} stages and "
                                 f"{self.num_microbatches} micro-batches, found {self.schedule!r:.120}")
        flight = max_in_flight(self.schedule) if self.in_flight is None else tuple(int(f) for f in self.in_flight)
        if len(flight) != self.num_stages or any(f < 0 for f in flight):
            raise PartitionError(f"PartitionProblem.in_flight: expected {self.num_stages} counts >= 0, found {flight!r}")
        object.__setattr__(self, "in_flight", flight)
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise PartitionError(f"PartitionProblem.bandwidth: expected a positive number of bytes/s "
                                 f"(math.inf for free transfers), found {self.bandwidth!r}")
        object.__setattr__(self, "latency", _check_seconds("PartitionProblem.latency", self.latency))
        if self.memory_budget is not None:
            budget = tuple(float(b) for b in self.memory_budget)
            object.__setattr__(self, "memory_budget", budget)
            if len(budget) != self.num_stages:
                raise PartitionError(f"PartitionProblem.memory_budget: expected {self.num_stages} values (one "
                                     f"per stage) or None, found {len(budget)}")
            for k, b in enumerate(budget):
                if not b >= 0:
                    raise PartitionError(f"PartitionProblem.memory_budget[{k}]: expected a non-negative "
                                         f"number of bytes (math.inf for unlimited), found {b}")
        if self.memory is not None:
            if not isinstance(self.memory, ManagedMemory):
                raise PartitionError(f"PartitionProblem.memory: expected a ManagedMemory or None, "
                                     f"found {self.memory!r}")
            self.memory.reserves(self.num_stages)

    @property
    def num_ops(self) -> int:
        return len(self.ops)


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` holds ops ``bounds[s]:bounds[s+1]``; figures are per micro-batch.

    ``fits_memory`` is False when :func:`evaluate` found a stage over its budget (a baseline
    may produce that; :func:`solve` never does).
    """

    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[int, ...]
    max_time: float
    moved_bytes: int
    fits_memory: bool = True

    def assignment(self, op_ids: Sequence[str]) -> dict[str, int]:
        """``op_id -> stage`` for the ops of the problem this partition was made for."""
        return {op_ids[k]: s for s in range(len(self.bounds) - 1) for k in range(self.bounds[s], self.bounds[s + 1])}


# ------------------------------------------------------------------------------ cost model


@dataclass(frozen=True)
class _Tables:
    """Prefix sums of a problem (and of the move costs against ``previous``)."""

    P: int
    compute: np.ndarray    # (N+1,) prefix of fwd + bwd
    static: np.ndarray     # (N+1,) prefix of param + optim bytes, int64
    act: np.ndarray        # (N+1,) prefix of act bytes, int64
    cut: np.ndarray        # (N+1,) cut bytes, int64
    comm: np.ndarray       # (N+1,) 2 * (latency + cut / bandwidth)
    in_flight: np.ndarray  # (P,) int64
    moved: np.ndarray      # (P, N+1) prefix of bytes that move if stage s takes the op, int64
    moved_ops: np.ndarray  # (P, N+1) prefix of the number of ops that move if stage s takes them
    budget: np.ndarray     # (P,) float, inf when unlimited
    busy_moved: np.ndarray  # (P, N+1) like ``moved``, counting only the ``busy`` ops
    busy_moved_ops: np.ndarray  # (P, N+1) like ``moved_ops``, counting only the ``busy`` ops
    resident: np.ndarray | None = None  # (N+1,) prefix of the managed state bytes (None: no manager)
    act_floor: np.ndarray | None = None  # (P, N+1) prefix of each op's least activation bytes ("auto")
    act_max: np.ndarray | None = None    # (N+1, N+1) [i, j]: the largest act_bytes of ops i..j-1 ("auto")
    reserve: np.ndarray | None = None    # (P,) bytes kept for prefetching
    arena_only: bool = False             # the budget bounds the manager's arena alone


def _tables(problem: PartitionProblem, previous: Mapping[str, int] | None,
            busy: AbstractSet[str] | None = None) -> _Tables:
    P, ops = problem.num_stages, problem.ops
    zero = np.zeros(1)
    state = np.array([op.param_bytes + op.optim_bytes for op in ops], dtype=np.int64)
    cut = np.array(problem.cut_bytes, dtype=np.int64)
    owner = np.full((1, len(ops)), -1, dtype=np.int64)  # -1: nobody owns it yet, placing it costs nothing
    for k, op in enumerate(ops if previous is not None else ()):
        o = previous.get(op.op_id)
        if o is not None and not _is_int(o):
            raise PartitionError(f"previous[{op.op_id!r}]: expected a stage index (int), found {o!r}")
        owner[0, k] = -1 if o is None else o
    moving = ((np.arange(P)[:, None] != owner) & (owner >= 0)).astype(np.int64)  # 1 where it would move
    moves = moving * state[None, :]
    budget = problem.memory_budget if problem.memory_budget is not None else (math.inf,) * P
    in_use = np.array([busy is None or op.op_id in busy for op in ops], dtype=np.int64)

    def prefix(a: np.ndarray) -> np.ndarray:
        return np.concatenate((np.zeros((P, 1), dtype=np.int64), np.cumsum(a, axis=1)), axis=1)

    flight = np.array(problem.in_flight, dtype=np.int64)
    managed: dict = {}
    mm = problem.memory
    if mm is not None:
        managed["resident"] = np.concatenate(([0], np.cumsum([mm.state_bytes(op) for op in ops]))).astype(np.int64)
        managed["reserve"] = np.array(mm.reserves(P), dtype=float)
        managed["arena_only"] = mm.arena is not None
        if mm.activations == "auto" and mm.arena is None:
            # pipeline.plan.activations' model with every op at its smallest choice: keep F*a,
            # swap min(F, 2)*a, recompute F*x (x: its input, cut_bytes[k]; the first op's is the
            # stage input, counted apart), plus the largest recomputed a (allowing every op)
            a = np.array([op.act_bytes for op in ops], dtype=np.int64)
            F = flight[:, None]
            least = np.minimum(np.minimum(F * a[None, :], np.minimum(F, 2) * a[None, :]), F * cut[None, :-1])
            managed["act_floor"] = prefix(least)
            amax = np.zeros((len(ops) + 1, len(ops) + 1), dtype=np.int64)
            for i in range(len(ops)):
                amax[i, i + 1:] = np.maximum.accumulate(a[i:])
            managed["act_max"] = amax

    return _Tables(
        P=P,
        compute=np.concatenate((zero, np.cumsum([op.fwd + op.bwd for op in ops]))),
        static=np.concatenate(([0], np.cumsum(state))).astype(np.int64),
        act=np.concatenate(([0], np.cumsum([op.act_bytes for op in ops]))).astype(np.int64),
        cut=cut,
        comm=2.0 * (problem.latency + cut / problem.bandwidth),
        in_flight=flight,
        moved=prefix(moves),
        moved_ops=prefix(moving),
        budget=np.array(budget, dtype=float),
        busy_moved=prefix(moves * in_use),
        busy_moved_ops=prefix(moving * in_use),
        **managed,
    )


def _stage_cost(t: _Tables, s, i, j):
    """Time, memory and moved bytes of stage(s) ``s`` holding ops ``[i, j)``; numpy-broadcasting."""
    s = np.asarray(s)
    time_ = (t.compute[j] - t.compute[i]) + np.where(s > 0, t.comm[i], 0.0) + np.where(s < t.P - 1, t.comm[j], 0.0)
    if t.resident is None:
        memory = (t.static[j] - t.static[i]) + t.in_flight[s] * ((t.act[j] - t.act[i]) + t.cut[i])
    elif t.arena_only:
        memory = (t.resident[j] - t.resident[i]) + t.reserve[s]
    elif t.act_floor is None:
        memory = ((t.resident[j] - t.resident[i]) + t.in_flight[s] * ((t.act[j] - t.act[i]) + t.cut[i])
                  + t.reserve[s])
    else:  # the first op's recompute keeps the stage input, already counted: ops i+1..j-1 only
        i1 = np.minimum(np.asarray(i) + 1, j)
        memory = ((t.resident[j] - t.resident[i]) + t.in_flight[s] * t.cut[i]
                  + (t.act_floor[s, j] - t.act_floor[s, i1]) + t.act_max[i, j] + t.reserve[s])
    moved = t.moved[s, j] - t.moved[s, i]
    return time_, memory, moved


def stage_cost(problem: PartitionProblem, stage: int, start: int, stop: int,
               previous: Mapping[str, int] | None = None) -> tuple[float, int, int]:
    """``(time, memory, moved_bytes)`` of ``stage`` holding ops ``[start, stop)``."""
    time_, memory, moved = _stage_cost(_tables(problem, previous), stage, start, stop)
    return float(time_), int(memory), int(moved)


def _make_partition(t: _Tables, bounds: Sequence[int]) -> Partition:
    b = np.asarray(bounds)
    times, memory, moved = _stage_cost(t, np.arange(t.P), b[:-1], b[1:])
    return Partition(
        bounds=tuple(int(x) for x in bounds),
        stage_times=tuple(float(x) for x in times),
        stage_memory=tuple(int(x) for x in memory),
        max_time=float(times.max()),
        moved_bytes=int(moved.sum()),
        fits_memory=bool((memory <= t.budget).all()),
    )


def evaluate(problem: PartitionProblem, bounds: Sequence[int],
             previous: Mapping[str, int] | None = None) -> Partition:
    """The stage times, memory and moved bytes of any given ``bounds`` (P + 1 values, 0..N)."""
    bounds = tuple(bounds)
    N, P = problem.num_ops, problem.num_stages
    if len(bounds) != P + 1 or not all(_is_int(b) for b in bounds):
        raise PartitionError(f"bounds: expected P + 1 = {P + 1} ints, found {bounds!r}")
    if bounds[0] != 0 or bounds[-1] != N or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise PartitionError(f"bounds: expected non-decreasing values from 0 to N = {N}, found {bounds!r}")
    return _make_partition(_tables(problem, previous), bounds)


def stage_work(problem: PartitionProblem, bounds: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...],
                                                                          tuple[float, ...]]:
    """What a schedule replay of split ``bounds`` needs: per stage the forward and backward
    seconds of its ops (one micro-batch), and per cut the seconds of its send (latency plus
    the cut's bytes over the bandwidth)."""
    b, P = bounds, problem.num_stages
    fwd = tuple(sum(op.fwd for op in problem.ops[b[s]:b[s + 1]]) for s in range(P))
    bwd = tuple(sum(op.bwd for op in problem.ops[b[s]:b[s + 1]]) for s in range(P))
    send = tuple(problem.latency + problem.cut_bytes[b[c + 1]] / problem.bandwidth for c in range(P - 1))
    return fwd, bwd, send


def kept_per_microbatch(problem: PartitionProblem, bounds: Sequence[int]) -> tuple[int, ...]:
    """Per stage of split ``bounds``, the activation bytes one micro-batch keeps there between its
    forward and backward: its ops' saved tensors and the stage's input (what the memory model
    counts once per micro-batch in flight, ``in_flight[s]`` times, without a tensor manager)."""
    b = bounds
    return tuple(sum(op.act_bytes for op in problem.ops[b[s]:b[s + 1]]) + problem.cut_bytes[b[s]]
                 for s in range(problem.num_stages))


# ---------------------------------------------------------------------------------- solver


def _grids(t: _Tables, n: int) -> tuple[np.ndarray, list, list, list]:
    """Per stage s, for every op range [i, j): the time where memory fits (inf elsewhere), the
    moved bytes and the memory; plus the mask i <= j."""
    idx = np.arange(n + 1)
    I, J = idx[:, None], idx[None, :]
    upper = I <= J
    fit, moved, mem = [], [], []
    for s in range(t.P):
        time_, memory, mv = _stage_cost(t, s, I, J)
        fit.append(np.where(upper & (memory <= t.budget[s]), time_, np.inf))
        moved.append(mv)
        mem.append(memory)
    return upper, fit, moved, mem


def _minmax_dp(mats: list[np.ndarray]) -> tuple[float, tuple[int, ...]]:
    """min over bounds of max_s mats[s][b_s, b_{s+1}]; returns the value and a minimiser."""
    best, args = mats[0][0], []
    for m in mats[1:]:
        cand = np.maximum(best[:, None], m)
        args.append(cand.argmin(axis=0))
        best = cand.min(axis=0)
    n = len(best) - 1
    bounds = [n]
    for arg in reversed(args):
        bounds.append(int(arg[bounds[-1]]))
    return float(best[n]), (0, *reversed(bounds))


def _infeasible(problem: PartitionProblem, t: _Tables, memory: list[np.ndarray], upper: np.ndarray) -> PartitionError:
    over = [np.where(upper, memory[s] - t.budget[s], np.inf) for s in range(t.P)]
    short, bounds = _minmax_dp(over)
    part = _make_partition(t, bounds)
    s = int(np.argmax(np.asarray(part.stage_memory) - t.budget))
    need, budget = part.stage_memory[s], t.budget[s]
    return PartitionError(
        f"memory_budget: no split of {problem.num_ops} ops over {t.P} stages fits. The closest one, bounds "
        f"{bounds}, needs {need / _MIB:.2f} MiB on stage {s} against memory_budget[{s}] = "
        f"{budget / _MIB:.2f} MiB: short by {short / _MIB:.2f} MiB ({short:.0f} bytes). Hint: raise "
        f"memory_budget[{s}], use more stages, or hold fewer micro-batches in flight "
        f"(schedule '1f1b' or a smaller num_microbatches; this problem uses {problem.schedule.name!r}, "
        f"M={problem.num_microbatches}){_manager_hint(problem.memory)}.", short_by=short, stage=s, closest=part)


def _manager_hint(mm: ManagedMemory | None) -> str:
    if mm is None:
        return ""
    hints = []
    if mm.optimizer == "device":
        hints.append("keep the optimizer state on the host (ManagedMemory.optimizer='host')")
    if mm.activations == "keep" and mm.arena is None:
        hints.append("let activations be swapped or recomputed (ManagedMemory.activations='auto')")
    return "".join(f", or {h}" for h in hints)


def _fewest_moves(T: list, MV: list, threshold: float, N: int, P: int) -> tuple[int, ...]:
    """The bounds with every stage's time <= ``threshold`` that move the fewest bytes, then have
    the smallest slowest stage, then the smallest bounds (``T`` is inf where memory does not fit)."""
    return _fewest_moves_many(T, MV, (threshold,), N, P)[0]


def _fewest_moves_many(T: list, MV: list, thresholds: Sequence[float], N: int, P: int) -> list[tuple[int, ...]]:
    """:func:`_fewest_moves` for several thresholds at once (one DP over a threshold axis)."""
    G = len(thresholds)
    th = np.asarray(thresholds, dtype=float)[:, None, None]
    # Suffix DP over (threshold, stage, first op): lexicographic min of (moved bytes, slowest stage).
    ga = [np.full((G, N + 1), np.inf) for _ in range(P + 1)]
    gb = [np.full((G, N + 1), np.inf) for _ in range(P + 1)]
    ga[P][:, N] = gb[P][:, N] = 0.0
    for s in reversed(range(P)):
        allowed = np.isfinite(T[s])[None] & (T[s][None] <= th)
        ca = np.where(allowed, MV[s][None] + ga[s + 1][:, None, :], np.inf)
        cb = np.maximum(T[s][None], gb[s + 1][:, None, :])
        ga[s] = ca.min(axis=2)
        gb[s] = np.where(np.isfinite(ga[s]), np.where(ca == ga[s][:, :, None], cb, np.inf).min(axis=2), np.inf)

    # Walk forward taking the smallest next bound that can still reach (moved, slowest) exactly.
    rows = np.arange(G)
    best_time, remaining = gb[0][:, 0], ga[0][:, 0].copy()
    i = np.zeros(G, dtype=np.int64)
    bounds = [i]
    for s in range(P):
        Ti, MVi = T[s][i], MV[s][i]  # (G, N + 1): the rows of each threshold's current bound
        ok = (np.isfinite(Ti) & (Ti <= th[:, :, 0]) & (MVi + ga[s + 1] == remaining[:, None])
              & (np.maximum(Ti, gb[s + 1]) <= best_time[:, None]))
        j = ok.argmax(axis=1)  # the first bound that works (there is one: the DP found it)
        remaining = remaining - MVi[rows, j]
        bounds.append(j)
        i = j
    return [tuple(int(b[g]) for b in bounds) for g in range(G)]


def single_stage(t: _Tables, n: int) -> Partition | None:
    """One stage has one partition, every op: the solvers' answer where it fits, without their
    search (a data-parallel run plans every subnet so, in the background, each step). None where
    there are several stages or it does not fit (the search then names the shortfall)."""
    if t.P != 1:
        return None
    whole = _make_partition(t, (0, n))
    return whole if whole.fits_memory else None


def solve(problem: PartitionProblem, previous: Mapping[str, int] | None = None, eps: float = 0.0) -> Partition:
    """The exact memory-feasible min-max partition, migration-aware within ``(1 + eps)``.

    ``previous`` maps op id -> the stage that owns it now (missing ops cost nothing to place).
    Among partitions whose slowest stage is within ``(1 + eps) * optimum`` this returns the one
    with the fewest moved bytes, then the smallest slowest stage, then the smallest bounds.
    Raises :class:`PartitionError` (with ``short_by``) when no partition fits the budgets.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise PartitionError(f"eps: expected a finite non-negative number, found {eps!r}")
    t = _tables(problem, previous)
    N, P = problem.num_ops, problem.num_stages
    whole = single_stage(t, N)
    if whole is not None:
        return whole
    upper, T, moved, MEM = _grids(t, N)
    MV = [m.astype(float) for m in moved]  # integral, exact below 2**53 bytes

    optimum, _ = _minmax_dp(T)
    if not math.isfinite(optimum):
        raise _infeasible(problem, t, MEM, upper)
    threshold = (1.0 + eps) * optimum * (1.0 + REL_SLACK)

    return _make_partition(t, _fewest_moves(T, MV, threshold, N, P))


# ------------------------------------------------------------------------ problems and timing


def random_problem(rng: np.random.Generator, num_ops: int, num_stages: int, num_microbatches: int = 4,
                   schedule: str = "1f1b", bandwidth: float = 1e9, latency: float = 1e-5,
                   memory_budget: tuple[float, ...] | None = None) -> PartitionProblem:
    """A random problem with op costs of a few milliseconds and megabytes (tests, benchmarks)."""
    ops = tuple(
        OpCost(f"op{k}", float(rng.uniform(1e-3, 5e-3)), float(rng.uniform(2e-3, 1e-2)),
               int(rng.integers(0, 8 << 20)), int(rng.integers(0, 16 << 20)), int(rng.integers(0, 4 << 20)))
        for k in range(num_ops))
    cuts = tuple(int(c) for c in rng.integers(1 << 16, 4 << 20, size=num_ops + 1))
    return PartitionProblem(ops, cuts, num_stages, num_microbatches, schedule, bandwidth, latency, memory_budget)
