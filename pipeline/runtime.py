"""The pipelined engine: one process per stage, a new partition and live migration per subnet.

Every rank runs the same program on the same data and never asks another rank what to do. The
engine ties four parts together, one concern each:

* :class:`pipeline.lookahead.LookaheadPlanner`: the plan of each subnet (pure code, no
  messages) and what crosses each cut;
* :mod:`pipeline.plan.admission`: the schedule of a training segment, subnets back to back —
  flushed steps (``pipeline.window`` 1, exact shared ops: the configured GPipe/1F1B per subnet
  and its update) or a cross-subnet schedule with several in flight — made a segment ahead in
  the background, with the tensor manager's arena bound;
* :class:`pipeline.executor.StageExecutor`: this rank's actions of that schedule (receive,
  compute, send, update), ops moving as the schedule's state messages, the tensor manager told
  the exact use order;
* :class:`pipeline.agreement.Agreement`: all ranks built the same segment, checked without a
  round trip on the critical path when it was made ahead.

Gradients accumulate in ascending micro-batch order on every stage, exactly as in the
reference, so the result is bit-identical. With ``pipeline.stages`` S below the world size N,
R = N / S replicas of the pipeline each run their share of the micro-batches, on channels of
their own, and :class:`pipeline.replicas.ReplicaReducer` folds each stage's gradients across
the replicas, in micro-batch order, before every update. Every phase runs under
:class:`pipeline.failures.FailureReporter` (rank, step and action of any failure) and every wait
has a timeout: no hang.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from supernet import Arch, SupernetGraph

from .agreement import Agreement, AgreementError, plan_what
from .engine import EvalResult, GradClip, LrSchedule, StepInput, StepResult, graph_has_batchnorm, split_batch
from .executor import Segment, StageExecutor
from .failures import FailureReporter, StageFailure, parse_fault
from .layout import choose_layout
from .lookahead import LookaheadPlanner, Plan
from .memory import MemoryModel, MemorySettings, OptimConfig, TensorManager
from .memory.peer import open_peer, peer_needed
from .memory.sizing import op_footprints
from .migration import Migrator
from .plan.admission import ActivationCap, ArenaBound, cross_subnet, sequential, stage_caps
from .plan.costs import CostTable
from .plan.placement import initial_owners
from .plan.schedule import Schedule, build as build_schedule, format_grid, validate
from .rendezvous import init_process_group
from .replicas import Mesh, ReplicaReducer, new_group_per
from .shm import DigestBoard
from .settings import DistEnv, PipelineSettings
from .shared import SharedOps, shared_ops_of
from .trace import Span, Tracer
from .transport import Transport, peer_errors

__all__ = ["PipelineEngine", "StageFailure", "Plan", "AgreementError"]

log = logging.getLogger(__name__)


def _shared_memory() -> bool:
    """Whether the replicas of a stage on one host reduce their gradients through shared memory,
    and the ranks on one host post their agreement digests there (``PIPENAS_REDUCE_SHM``,
    default 1; 0 sends both over the wire as between hosts)."""
    value = os.environ.get("PIPENAS_REDUCE_SHM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PIPENAS_REDUCE_SHM: expected 0 or 1, found {value!r}")
    return value == "1"


@dataclass
class StepStats:
    """What this rank measured in its last step (for benchmarks and tests)."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    max_in_flight: int = 0
    migrated_ops: int = 0
    migrated_bytes: int = 0
    migration_s: float = 0.0  # waiting for moved ops (state messages) on the critical path
    wait_s: float = 0.0  # waiting for the schedule's messages
    plan_s: float = 0.0  # planning time on the critical path (near zero when planned ahead)
    early_migrated_ops: int = 0  # over the run: moves for a segment's later subnets (off the critical path)
    planned_ahead: bool = False
    bounds: tuple[int, ...] = ()  # the partition of the last step (or evaluation)
    swapped_bytes: int = 0  # activations swapped to host memory (memory.activations)
    recomputed_ops: int = 0  # op forwards whose activations were recomputed in the backward
    overlapped: int = 0  # cross-subnet, over the run: subnets that began here before the one before ended


@dataclass(frozen=True)
class _Prepared:
    """A segment made ready: for which (archs, owners, subnet before), its plans and schedule,
    where it leaves the ops with state, and the digest every rank must hold alike."""

    key: tuple
    plans: tuple[Plan, ...]
    schedule: Schedule
    owners: dict[str, int]
    digest: int
    tail: tuple[tuple[str, int, int], ...] = ()  # (op, from, to): moves for the subnet after, sent at the start


def overlapped(row: Sequence) -> int:
    """How many subnets begin on this stage (first forward) before the one before is updated."""
    pos = {(a.kind, a.microbatch, a.subnet): i for i, a in enumerate(row)}
    return sum(1 for (k, m, t), i in pos.items() if k == "F" and m == 0 and t > 0 and i < pos[("U", 0, t - 1)])


def _take(mbs: list, share: range) -> list:
    return [mbs[m] for m in share]


def share_of(x: torch.Tensor, y: torch.Tensor, batch_size: int | None, microbatches: int, share: range,
             device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """A replica's micro-batches ``share`` of M = ``microbatches``, and the whole batch's size, from
    either the whole batch or just the share's rows (what ``input_rows`` asked the data for)."""
    whole = x.shape[0] if batch_size is None else batch_size
    if x.shape[0] == whole:
        return _take(split_batch(x.to(device), y.to(device), microbatches), share), whole
    rows = whole // microbatches * len(share)
    if x.shape[0] != rows:
        raise ValueError(f"train_step: expected the whole batch ({whole} rows) or this replica's {rows} rows, "
                         f"found {x.shape[0]}")
    return split_batch(x.to(device), y.to(device), len(share)), whole


def _segment_key(archs: Sequence[Arch], owners: Mapping[str, int], prior: Arch | None, tail: Arch | None) -> tuple:
    """What a prepared segment was made for: its subnets, the op placement before it, the subnet
    before, and the subnet after it (whose ops the segment does not use move during it)."""
    return tuple(archs), dict(owners), prior, tail


class PipelineEngine:
    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int, lr: LrSchedule,
                 settings: PipelineSettings, env: DistEnv, device: torch.device,
                 failure_dir: str | os.PathLike | None = None, costs: CostTable | None = None,
                 trace_steps: Iterable[int] = (), memory: MemorySettings | None = None,
                 checkpoint_every: int = 0, sample_shape: Sequence[int] | None = None,
                 batch_size: int | None = None, clip_grad_norm: float | None = None) -> None:
        self.graph, self.seed, self.optim, self.lr = graph, seed, optim, lr
        self.clip = GradClip(clip_grad_norm) if clip_grad_norm is not None else None  # train.clip_grad_norm
        self.microbatches, self.settings, self.device = microbatches, settings, device
        self.rank, self.world_size = env.rank, env.world_size
        self.batch_size = batch_size  # the whole training batch (a replica may be given only its rows)
        if not dist.is_initialized():
            backend = settings.backend if settings.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
            if device.type == "cuda":
                torch.cuda.set_device(env.local_rank)
                self.device = device = torch.device("cuda", env.local_rank)
            init_process_group(backend, env.rank, env.world_size, settings.timeout_s)  # restart-safe under torchrun
        # the 2-D mesh: R replicas of an S-stage pipeline (pipeline/replicas.py); R = 1: one
        # process per stage, exactly as without replicas. ``auto`` stages or window: chosen from
        # this machine's measured costs, every rank alike (pipeline/layout.py: choose_layout)
        self.layout, measured, self.runtime_costs = choose_layout(
            settings, memory, env.rank, env.world_size, microbatches, graph, optim, sample_shape, batch_size, device,
            seed, costs)
        if self.layout.window is not None:
            self.settings = settings = dataclasses.replace(settings, window=self.layout.window)
        costs = costs if costs is not None else measured  # the planner prices with what chose the layout
        self.mesh = Mesh.of(env.rank, env.world_size, self.layout.stages, microbatches)
        self.num_stages, self.replicas, self.stage_index = self.mesh.stages, self.mesh.replicas, self.mesh.stage
        self.local_microbatches = microbatches // self.replicas  # what this replica's schedule runs
        timeout = settings.timeout_s
        many = env.world_size > 1
        me, mesh = self.stage_index, self.mesh
        # Separate groups are separate channels: evaluation's moves, gathers and evaluation
        # (default group; with replicas, one per replica), the schedule's messages, the ops
        # moving in a segment (state messages), and the agreement check (all ranks: every
        # replica plans alike too).
        if self.replicas == 1:
            self.transport = Transport(me, self.device, timeout)
            self._schedule_transport = Transport(me, self.device, timeout, group=dist.new_group()) if many else self.transport
            state = Transport(me, self.device, timeout, group=dist.new_group()) if many else self.transport
            self.reducer: ReplicaReducer | None = None
        else:
            peers = mesh.stage_ranks()
            self.transport = Transport(me, self.device, timeout, group=new_group_per(mesh, "stage"), peers=peers)
            self._schedule_transport = Transport(me, self.device, timeout, group=new_group_per(mesh, "stage"), peers=peers)
            state = Transport(me, self.device, timeout, group=new_group_per(mesh, "stage"), peers=peers)
            rgroup, bgroup = new_group_per(mesh, "replica"), new_group_per(mesh, "replica")
            self.reducer = ReplicaReducer(mesh, Transport(mesh.replica, self.device, timeout, group=rgroup,
                                                          peers=mesh.replica_ranks()), rgroup,
                                          Transport(mesh.replica, self.device, timeout, group=bgroup,
                                                    peers=mesh.replica_ranks()), settings.reduce,
                                          shared_memory=_shared_memory(),
                                          shm_bytes=sum(c.param_bytes for c in costs.ops.values()) if costs else 0)
        agree = dist.new_group() if many else None
        board = (DigestBoard.open(agree, env.rank, env.world_size, self.device, timeout)
                 if many and settings.check_agreement and _shared_memory() else None)  # (collective)
        self.agreement = Agreement(self.device, timeout, settings.check_agreement, agree, board)
        # the peer tier (memory.activations peer | auto): stage s hands saved activations to P - 1 - s
        self.peer = (open_peer(me, self.num_stages, self.transport.global_rank, self.device, timeout)
                     if peer_needed(memory, self.num_stages, env.world_size) else None)
        self.schedule: Schedule = build_schedule(settings.schedule, self.num_stages, self.local_microbatches)
        validate(self.schedule)
        self.owners = initial_owners(graph.slots(), self.num_stages)
        # ``memory``: with a device budget this stage's ops live in host memory behind a bounded
        # device arena, fetched ahead from the plans of the coming steps (pipeline/memory/)
        self.tensors = TensorManager(graph, seed, optim, self.device,
                                     own=[op for op, s in self.owners.items() if s == me], memory=memory)
        self.stats = StepStats()
        fd = failure_dir if failure_dir is not None else os.environ.get("PIPENAS_FAILURE_DIR")
        self.failures = FailureReporter(self.rank, self.schedule, Path(fd) if fd else None,
                                        parse_fault(os.environ.get("PIPENAS_FAULT")),
                                        where=f"replica {mesh.replica}, stage {me}" if self.replicas > 1 else None)
        self.tracer = Tracer(self.rank, trace_steps)
        self.planner = LookaheadPlanner(graph, seed, self.num_stages, self.local_microbatches, settings, costs,
                                        can_move_early=self.num_stages > 1, optim_name=optim.name,
                                        memory=self._memory_model(), schedule=self.schedule,
                                        runtime=self.runtime_costs, replicas=self.replicas)
        offset = self.mesh.microbatches(microbatches).start  # this replica's first micro-batch
        self._last_arch: Arch | None = None  # the subnet of the last training step
        # shared ops read exactly, late or frozen (several subnets in flight need one of the last two);
        # a delayed op's compensation (pipeline.delay_compensation) is the reference's rule
        self.shared = SharedOps(settings.shared_ops, settings.shared_delay, shared_ops_of(graph), checkpoint_every,
                                self.tensors.module, settings.delay_compensation, settings.delay_compensation_coef,
                                delays=settings.shared_delays)
        self.migrator = Migrator(me, self.owners, self.tensors, self.transport, self.shared)
        # clipping: every update waits for the subnet's gradient norm (by the schedule's messages;
        # with replicas each stage folds a subnet's gradients at its last backward, before its sums leave)
        self.executor = StageExecutor(me, graph, self.tensors, self.shared, self._schedule_transport, state,
                                      self.failures, self.tracer, self.device, seed, reducer=self.reducer,
                                      offset=offset, clipper=self._clipper if self.clip is not None else None,
                                      peer=self.peer.client if self.peer is not None else None)
        self.checkpoint_every = checkpoint_every
        self._segment_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipenas-segment")
        self._ahead: Future | None = None  # the next segment's plans and schedule, being made
        self._hint: list[Arch] = []  # plan_ahead: the subnets after the next train_step's
        self._call_steps = 0  # the most steps one train_steps call has handed over (the next segment's length)
        self._schedules: dict[tuple, tuple[Schedule, int]] = {}  # _prepared's memo (insertion order: oldest first)
        self._full_footprint: dict[str, int] | None = None  # per op, arena bytes with its optimizer state

    def _arena_bound(self) -> ArenaBound | None:
        """What the admission builder bounds the subnets in flight by: each stage's arena and
        each op's bytes there; with the hybrid placement *with* its optimizer state (an op in use
        keeps what it was fetched with, which may be its state: only ops not in use can shed
        it), so the ops pinned together always fit. None without a budget."""
        mm = self.planner.memory
        if mm is None or mm.arena_bytes is None:
            return None
        if self.tensors.memory.optimizer != "hybrid":  # the state always or never comes along: exact
            return ArenaBound(mm.arena_bytes, mm.footprint)
        if self._full_footprint is None:
            device_state = dataclasses.replace(self.tensors.memory, optimizer="device")
            self._full_footprint = op_footprints(self.graph, self.seed, self.optim, self.device, device_state)
        return ArenaBound(mm.arena_bytes, self._full_footprint)

    def _memory_model(self) -> MemoryModel:
        """The planner's view of the memory settings: every stage's arena capacity (gathered:
        a fraction of free device memory differs between devices) and each op's bytes there."""
        if not self.tensors.virtual:
            return MemoryModel(self.tensors.memory)
        with self.failures.failing(-1, "plan"):
            arenas: list = [None] * self.num_stages  # this replica's stages (every replica alike)
            with peer_errors("gathering the stages' arena sizes"):
                dist.all_gather_object(arenas, self.tensors.stats().budget_bytes, group=self.transport.group)
        footprint = self.tensors.footprints(slot.op_id for slot in self.graph.slots())
        return MemoryModel(self.tensors.memory, tuple(int(b) for b in arenas), footprint)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _batch(self, x: torch.Tensor) -> int:
        """The whole training batch's size (``x`` may be a replica's rows of it)."""
        return x.shape[0] if self.batch_size is None else self.batch_size

    def input_rows(self, batch_size: int) -> range | None:
        """A replica's rows of each batch (its micro-batches'); None without replicas."""
        if self.replicas == 1:
            return None
        share, per = self.mesh.microbatches(self.microbatches), batch_size // self.microbatches
        return range(share.start * per, share.stop * per)

    @property
    def last(self) -> int:
        return self.num_stages - 1

    @property
    def costs(self) -> CostTable | None:
        return self.planner.costs

    # -- planning --------------------------------------------------------------------------
    def plan(self, arch: Arch) -> Plan:
        """The partition of ``arch`` given where ops sit now (pure: no messages, no side effects)."""
        return self.planner.plan_with(arch, self.owners, self._last_arch)

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """The subnets that follow the next ``train_step``'s (the sampler's lookahead): prepared
        in the background while that step computes. A hint only: the result is the same either way."""
        self._hint = list(archs)

    def _schedule_of(self, plans: Sequence[Plan], origin: Mapping[str, int], used: frozenset[str]) -> Schedule:
        """The schedule of ``plans`` back to back (pure): flushed steps of the configured
        schedule, or a cross-subnet schedule bounded by the tensor manager's arena. ``used``:
        the ops with state the plans run."""
        uses = [p.work.uses for p in plans]
        origin = {op: origin[op] for op in used}
        if not self.settings.cross:
            return validate(sequential(self.schedule, uses, origin=origin, norms=self._norms))
        return validate(cross_subnet(
            [p.work for p in plans], self.local_microbatches, self.settings.window, frozen=self.shared.frozen & used,
            delayed=self.shared.delayed & used, delay=self.settings.shared_delay, delays=self.shared.own_delays,
            origin=origin,
            state_time=self.planner.move_seconds(), arena=self._arena_bound(),
            split=self.settings.split_backward,  # the B/W split, each W where its stage idles
            activations=self._activation_cap(plans), norms=self._norms))

    @property
    def _norms(self) -> bool:
        """Whether the schedule carries clipping's gradient norms from stage to stage."""
        return self.clip is not None and self.num_stages > 1

    def _activation_cap(self, plans: Sequence[Plan]) -> ActivationCap | None:
        """With ``pipeline.inflight=bytes``: each stage's in-flight cap in the activation bytes the
        count cap needs for the plans' heaviest subnet there (None: the count cap)."""
        if self.settings.inflight != "bytes":
            return None
        return ActivationCap.like(stage_caps(self.num_stages, self.settings.split_backward), [p.kept for p in plans])

    def _prepare(self, archs: Sequence[Arch], owners: Mapping[str, int], prior: Arch | None,
                 tail: Arch | None) -> _Prepared:
        """The plans of ``archs`` (chained through the placement each leaves, from ``owners``
        and the subnet before, ``prior``) and their schedule. Pure: every rank makes the same,
        now or in the background a segment ahead."""
        key = _segment_key(archs, owners, prior, tail)
        owners = dict(owners)  # (chain moves it on, subnet by subnet)
        plans = [plan for _, plan in self.planner.chain(archs, owners, prior)]
        return self._prepared(key, plans, owners)

    def _tail_moves(self, plans: Sequence[Plan], owners: dict[str, int], tail: Arch | None,
                    used: frozenset[str]) -> tuple:
        """The moves the subnet after the segment (``tail``) needs of ops the segment does not
        use, on any stage: their state cannot change during it, so they travel while it runs
        (sent at its start, received at its end), off the next segment's critical path; the
        plan of ``tail`` (from ``owners``, where the segment leaves the ops) is the one the next
        segment will make. ``owners`` is updated with them."""
        if tail is None or self.num_stages == 1:
            return ()
        nxt = self.planner.plan_with(tail, owners, plans[-1].arch, wires=False)
        moves = tuple(sorted((op, owners[op], s) for op, s in self.planner.placed(nxt).items()
                             if owners[op] != s and op not in used))
        owners.update({op: dst for op, _, dst in moves})
        return moves

    def _prepared(self, key: tuple, plans: Sequence[Plan], owners: dict[str, int]) -> _Prepared:
        """The segment's schedule and digest, memoised by its plans and where their ops with
        state start (a subnet trained again from the same placement, as in a step-by-step loop,
        costs no rebuild: the planning thread stays off the GIL while the step computes)."""
        used = frozenset().union(*(u for p in plans for u in p.work.uses))
        memo_key = (tuple(p.digest for p in plans), tuple(key[1][op] for op in sorted(used)))
        hit = self._schedules.get(memo_key)
        if hit is None:
            schedule = self._schedule_of(plans, key[1], used)
            h = hashlib.sha256(format_grid(schedule).encode())
            for p in plans:
                h.update(p.digest.to_bytes(8, "little"))
            hit = self._schedules[memo_key] = (schedule, int.from_bytes(h.digest()[:7], "little"))
            if len(self._schedules) > 64:
                self._schedules.pop(next(iter(self._schedules)))
        tail = self._tail_moves(plans, owners, key[3], used)
        digest = hit[1] ^ (int.from_bytes(hashlib.sha256(repr(tail).encode()).digest()[:7], "little") if tail else 0)
        return _Prepared(key, tuple(plans), hit[0], owners, digest, tail)

    def _take(self, archs: Sequence[Arch], tail: Arch | None) -> _Prepared:
        """The segment of ``archs`` (then ``tail``) from here: the one prepared ahead (or its
        first subnets, with their schedule rebuilt), else made now."""
        ahead, self._ahead = self._ahead, None
        ready = ahead.result() if ahead is not None else None  # re-raises its error
        key = _segment_key(archs, self.owners, self._last_arch, tail)
        self.stats.planned_ahead = ready is not None
        if ready is not None and ready.key == key:
            return ready
        n = len(archs)
        if ready is not None and ready.key[0][:n] == key[0] and ready.key[1:3] == key[1:3]:
            owners = dict(self.owners)
            for plan in ready.plans[:n]:
                owners.update(self.planner.placed(plan))
            return self._prepared(key, ready.plans[:n], owners)
        self.stats.planned_ahead = False
        return self._prepare(archs, self.owners, self._last_arch, tail)

    # -- training --------------------------------------------------------------------------
    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """One training step: a segment of one subnet (the next one ``plan_ahead`` named is
        prepared meanwhile, a segment of one too, so its agreement check is the one posted)."""
        hint, self._hint = self._hint, []
        return self._train_segment([(step, arch, x, y)], hint, 1)[0]

    def _clipper(self, norms: dict[int, torch.Tensor] | None):
        """``train.clip_grad_norm`` for one subnet's update: the whole subnet's per-op sums of
        squares, in op order (stage by stage), added on every rank alike: the norm one process
        computes. ``norms``: the other stages' sums, sent to this one after their last backward
        of the subnet (the schedule's ``norm`` messages; with replicas, of the gradients folded
        there), and this stage's own under its index when it sent them (not taken twice); one
        stage: none. None: no clipping."""
        if self.clip is None:
            return None
        me, got = self.stage_index, dict(norms or {})
        own = got.pop(me, None)  # this stage's sums, taken when it sent them

        def gather(mine: torch.Tensor) -> torch.Tensor:
            return torch.cat([mine if s == me else got[s] for s in range(self.num_stages) if s == me or s in got])

        return lambda mods: self.clip(mods, self.device, gather if got else None, own) if mods else None

    def train_steps(self, items: Sequence[StepInput], upcoming: Sequence[Arch] = ()) -> list[StepResult]:
        """Train ``items`` in order as segments (subnets back to back: flushed steps, or several
        in flight with ``pipeline.window`` > 1 or delayed/frozen shared ops), one per run of
        items between checkpoint boundaries; ``upcoming``: the subnets after them, prepared meanwhile."""
        self._call_steps = max(self._call_steps, len(items))
        runs: list[list] = [[]]
        for item in items:  # a segment never spans a checkpoint boundary (delayed shared ops restart there)
            if runs[-1] and self.checkpoint_every and item[0] % self.checkpoint_every == 0:
                runs.append([])
            runs[-1].append(item)
        head = 2 * self.settings.window
        if self._ahead is None and len(runs[0]) > head:
            # nothing was prepared ahead (the first segment, or after an evaluation): plan a short
            # segment now and the rest in the background while it runs
            runs[:1] = [runs[0][:head], runs[0][head:]]
        out = []
        for k, run in enumerate(runs):
            # what follows: the later runs of this call, then the lookahead; the next segment is
            # the next run, else the lookahead up to a checkpoint boundary
            following = [it[1] for later in runs[k + 1:] for it in later] + list(upcoming)
            after = run[-1][0] + 1
            # the next segment as the caller will hand it over: as many steps as its longest call
            # so far (the app's segment: one flushed step, or a cross-subnet run), up to a
            # checkpoint boundary. Prepared any longer, its agreement check, posted ahead, would
            # check a digest no rank runs, and the segment would pay a check of its own, a round
            # trip before it starts (measured: every step of the default data-parallel run, before)
            until = self.checkpoint_every - after % self.checkpoint_every if self.checkpoint_every else len(upcoming)
            n_next = len(runs[k + 1]) if k + 1 < len(runs) else len(list(upcoming)[:min(until, self._call_steps)])
            out += self._train_segment(run, following, n_next)
        return out

    def _train_segment(self, items: Sequence[StepInput], following: Sequence[Arch], n_next: int) -> list[StepResult]:
        """Subnets back to back: plan each (chained through the op placement each leaves), build
        the schedule every rank builds alike (both made a segment ahead, in the background),
        check that the ranks agree, run this stage's actions."""
        t0 = time.perf_counter()
        steps = tuple(int(it[0]) for it in items)
        archs = [it[1] for it in items]
        M = self.microbatches
        with self.failures.failing(steps[0], "plan"), self.tracer.span(steps[0], "plan", "plan"):
            # posted when the segment before ended, for the segment prepared ahead (it may hold
            # more subnets than this one runs): a disagreement there is checked on what runs now
            checked = self.agreement.read(strict=False)
            self.planner.ensure(items[0][2], self._batch(items[0][2]) // M, training=True)
            following = list(following)
            upcoming = following[:n_next]  # the next segment, prepared while this one runs
            prep = self._take(archs, following[0] if following else None)
            self.agreement.check(prep.digest, "the segment's subnets, partitions or schedule", checked)
            if upcoming:
                self._ahead = self._segment_pool.submit(self._prepare, upcoming, prep.owners, archs[-1],
                                                        following[n_next] if len(following) > n_next else None)
        plans, schedule = prep.plans, prep.schedule
        self.stats.plan_s = time.perf_counter() - t0
        self.failures.schedule = schedule
        share = self.mesh.microbatches(M)  # this replica's micro-batches (the data may have read just their rows)
        shares = [share_of(x, y, self.batch_size, M, share, self.device) for _, _, x, y in items]
        me = self.stage_index
        after = tuple(p.work.uses[me] for p in self._ready_plans(upcoming))
        seg = Segment(steps, tuple(plans), schedule, tuple(mbs for mbs, _ in shares),
                      tuple(batch for _, batch in shares), tuple(self.lr(s) for s in steps), after, prep.tail)
        posted = False

        def post_next() -> None:
            """The next segment's agreement check, posted once it is prepared: during this
            segment (the all-reduce then runs while it computes), at its end at the latest.
            Every rank posts once per segment, in the same order, whenever its own is ready."""
            nonlocal posted
            ahead = self._ahead
            if not posted and (ahead is None or (ahead.done() and ahead.exception() is None)):
                posted = True
                self._post_next()

        values, run = self.executor.run(seg, between=post_next)
        self.owners.update(prep.owners)  # where each op with state is now (every rank alike)
        self._last_arch = archs[-1]
        if not posted:
            with self.failures.failing(steps[-1], "plan"):  # (a preparation that failed raises here)
                self._post_next()
        wall = time.perf_counter() - t0
        moves, ahead = [0] * len(steps), len(prep.tail)  # tail moves travel while the segment computes
        for mv in schedule.rule.moves():
            moves[mv.before.subnet] += 1
            ahead += mv.before.subnet > 0  # travels while the segment's earlier subnets compute
        moves[-1] += len(prep.tail)
        st = self.stats
        st.wall_s, st.busy_s, st.wait_s, st.max_in_flight = wall, run.busy_s + run.update_s, run.wait_s, run.max_in_flight
        st.bounds = plans[-1].partition.bounds
        st.overlapped += overlapped(schedule.actions[me])
        st.migrated_ops, st.migrated_bytes = sum(moves), sum(run.moved_bytes)
        st.early_migrated_ops += ahead
        st.migration_s = sum(run.moved_wait_s)
        st.swapped_bytes, st.recomputed_ops = run.swapped_bytes, run.recomputed_ops
        return [StepResult(step, arch, float(sum(v)), v, wall / len(steps), moves[t], run.moved_bytes[t],
                           memory=run.memory[t], migration_s=run.moved_wait_s[t], **run.activations[t])
                for t, (step, arch, v) in enumerate(zip(steps, archs, values))]

    def _ready_plans(self, upcoming: Sequence[Arch]) -> Sequence[Plan]:
        """The plans of the next segment if it is already prepared (the tensor manager fetches
        toward them); none otherwise (never waits)."""
        ahead = self._ahead
        if not upcoming or ahead is None or not ahead.done() or ahead.exception() is not None:
            return ()
        return ahead.result().plans

    def _post_next(self) -> None:
        """Start the agreement check of the segment prepared for next (waiting for it), read
        when that segment starts; nothing when none is being prepared."""
        if self._ahead is not None:
            self.agreement.post(self._ahead.result().digest, "the next segment's subnets, partitions or schedule")

    def _drop_ahead(self) -> None:
        """Wait for (and drop) a segment being prepared: the planner is about to be used here."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.result()

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        self._drop_ahead()
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        calib = [(x.to(self.device), y) for x, y in calib_batches] if graph_has_batchnorm(self.graph) else []
        if not batches:
            return EvalResult(float("nan"), 0, 0)
        with self.failures.failing(-1, "plan"):
            self.agreement.read(strict=False)  # the next training segment's check, posted when the last one ended
            self.planner.ensure(batches[0][0], batches[0][0].shape[0], training=False)
            t0 = time.perf_counter()
            with self.tracer.span(-1, "plan", "plan"):
                plan = self.planner.plan_with(arch, self.owners, self._last_arch)
                self.agreement.check(plan.digest, plan_what(plan))
            self.stats.plan_s, self.stats.bounds = time.perf_counter() - t0, plan.partition.bounds
        with self.failures.failing(-1, "migrate"), self.tracer.span(-1, "migrate", "migrate"):
            self.migrator.now(plan.active, plan.partition.bounds)  # to the evaluation's placement
        mine = plan.slices[self.stage_index]
        self.tensors.ensure([op.op_id for op in mine.ops])
        try:  # every replica evaluates alike (same batches): the same result on every rank
            return self.executor.evaluate(mine, self.num_stages, batches, calib, self.transport)
        finally:
            self.tensors.release_step(advance=False)

    # -- state -----------------------------------------------------------------------------
    def op_states(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Gather every op's flat state on rank 0 (collective)."""
        with self.failures.failing(-1, "gather"):
            if self.mesh.replica != 0:  # every replica holds the same bytes: replica 0's pipeline gathers
                return None
            return self.migrator.gather()

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the state of the ops this rank owns with ``states`` (every rank passes the same;
        an op not in it keeps its state, and one without ``optim/`` entries gets a fresh optimizer)."""
        for op_id in self.tensors.owned():
            if op_id in states:
                self.tensors.export(op_id)
                self.tensors.adopt(op_id, states[op_id])

    def trace_spans(self) -> list[Span] | None:
        """Every rank's recorded spans on rank 0 (collective); None on the others."""
        with self.failures.failing(-1, "trace"):
            gathered: list = [None] * self.world_size
            with peer_errors("gathering the ranks' traces"):
                dist.all_gather_object(gathered, self.tracer.spans)
        return [sp for spans in gathered for sp in spans] if self.rank == 0 else None

    def close(self) -> None:
        """Orderly teardown: after a clean run all ranks meet at a barrier before the process
        group goes (no rank tears down links a peer still uses); after a failure, no waiting."""
        ok = not self.failures.failed
        self._segment_pool.shutdown(wait=ok, cancel_futures=True)
        if ok:
            self.agreement.read(strict=False)  # a check posted for a segment that never ran
        if self.peer is not None:
            self.peer.close(wait=ok)
        self.tensors.close()
        if dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


