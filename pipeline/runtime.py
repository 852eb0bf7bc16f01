"""The pipelined engine: one process per stage, a new partition and live migration per subnet.

Every rank runs the same program on the same data: it samples the same arch, builds the same
cost problem and plans the same partition (pure code, no messages), then cheaply checks that
all ranks agree (one all-reduce of an arch/plan hash). Ops that the new partition places
elsewhere migrate point-to-point with their optimizer state. Then each rank walks its own
action list of the schedule (``1F0``, ``1B0``, ...) running its slice of the subnet with the
same per-op executor as the reference, receives its inputs and sends its outputs, and steps
the optimizer for the ops it owns. Gradients accumulate in ascending micro-batch order on
every stage, exactly as in the reference, so the result is bit-identical.

Failures: every phase runs under :class:`pipeline.failures.FailureReporter`, which turns any
exception into a :class:`StageFailure` naming rank, step and action. Every wait on another rank
has a timeout: no hang.
"""
from __future__ import annotations

import datetime
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

from supernet import Arch, OpContext, Slice, SliceRun, SupernetGraph, classification_loss, cut, loss_and_grad

from .plan.costs import CostTable, analytic_costs, mean_problem, subnet_problem
from .engine import EvalResult, LrSchedule, StepResult, graph_has_batchnorm, recalibrated_bn, split_batch
from .plan.partition import Partition
from .plan.planners import StaticPlanner, make_planner
from .plan.placement import Move, initial_owners, moves, stages_of
from .plan.schedule import Schedule, build as build_schedule, forward_only, validate
from .settings import DistEnv, PipelineSettings
from .tensors import OptimConfig, TensorManager
from .failures import FailureReporter, StageFailure, parse_fault
from .transport import Transport

__all__ = ["PipelineEngine", "StageFailure", "Plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Where one subnet runs: its partition and each stage's slice."""

    arch: Arch
    partition: Partition
    slices: tuple[Slice, ...]
    digest: int


@dataclass
class StepStats:
    """What this rank measured in its last step (for benchmarks and tests)."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    max_in_flight: int = 0
    migrated_ops: int = 0
    migrated_bytes: int = 0
    plan_s: float = 0.0  # planning time on the critical path (near zero when planned ahead)
    early_migrated_ops: int = 0  # ops that moved during the previous step, off the critical path
    planned_ahead: bool = False
    bounds: tuple[int, ...] = ()  # the partition of the last step (or evaluation)


class PipelineEngine:
    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int, lr: LrSchedule,
                 settings: PipelineSettings, env: DistEnv, device: torch.device,
                 failure_dir: str | os.PathLike | None = None, costs: CostTable | None = None) -> None:
        # ``costs``: the table to plan with (e.g. pipeline.profile.shared_profile); every rank
        # must pass the same one. None: the analytic model at the first batch's shape.
        self.graph, self.seed, self.optim, self.lr = graph, seed, optim, lr
        self.microbatches, self.settings, self.device = microbatches, settings, device
        self.rank, self.world_size = env.rank, env.world_size
        self.num_stages = settings.stages or env.world_size
        if self.num_stages != env.world_size:
            raise ValueError(
                f"pipeline.stages: expected the world size {env.world_size} (one process per stage), "
                f"found {self.num_stages}"
            )
        if not dist.is_initialized():
            backend = settings.backend if settings.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
            if device.type == "cuda":
                torch.cuda.set_device(env.local_rank)
                self.device = device = torch.device("cuda", env.local_rank)
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=settings.timeout_s))
        self.transport = Transport(self.rank, self.device, settings.timeout_s)
        # Ops that the next step needs elsewhere and this step does not use migrate during this
        # step, on a group of their own so their messages never interleave with the schedule's.
        self._early_transport = (Transport(self.rank, self.device, settings.timeout_s, group=dist.new_group())
                                 if env.world_size > 1 else None)
        self._early_job: Future | None = None
        self._early_moves: list[Move] = []
        self._early_states: dict[str, dict[str, torch.Tensor]] = {}
        self._early_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipenas-migrate")
        self._committed: Plan | None = None
        self.schedule: Schedule = build_schedule(settings.schedule, self.num_stages, microbatches)
        validate(self.schedule)
        self.planner = None  # built with the cost table (the static planner needs it)
        self.owners = initial_owners(graph.slots(), self.num_stages)
        self.tensors = TensorManager(graph, seed, optim, self.device,
                                     own=[op for op, s in self.owners.items() if s == self.rank])
        self.costs: CostTable | None = costs
        self.stats = StepStats()
        fd = failure_dir if failure_dir is not None else os.environ.get("PIPENAS_FAILURE_DIR")
        self.failures = FailureReporter(self.rank, self.schedule, Path(fd) if fd else None,
                                        parse_fault(os.environ.get("PIPENAS_FAULT")))
        self._upcoming: list[Arch] = []
        self._ahead: dict[tuple, Plan] = {}
        self._ahead_job: Future | None = None
        self._ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipenas-plan")
        self._step = -1
        self._last_arch: Arch | None = None  # the subnet of the last training step

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> int:
        return self.num_stages - 1

    # -- planning --------------------------------------------------------------------------
    def _ensure_costs(self, x: torch.Tensor, microbatch: int) -> None:
        if self.costs is None:
            self.costs = analytic_costs(self.graph, tuple(x.shape[1:]), microbatch, self.optim.name)
        if self.planner is None:
            self.planner = self._make_planner()

    def _make_planner(self):
        name = self.settings.planner
        if name == "dynamic":
            return make_planner(name, eps=self.settings.eps, objective=self.settings.objective,
                                move_latency=self.settings.link_latency_s + self.settings.migration_overhead_s)
        if name == "static":
            return StaticPlanner.from_problem(mean_problem(
                self.graph, self.costs, num_stages=self.num_stages, num_microbatches=self.microbatches,
                schedule=self.settings.schedule, bandwidth=self.settings.link_bandwidth,
                latency=self.settings.link_latency_s, memory_budget=self.settings.budgets(self.num_stages)))
        return make_planner(name)

    def _problem(self, active):
        return subnet_problem(self.graph, active, self.costs, self.num_stages, self.microbatches,
                              self.settings.schedule, self.settings.link_bandwidth, self.settings.link_latency_s,
                              self.settings.budgets(self.num_stages))

    def _plan_with(self, arch: Arch, owners: Mapping[str, int], before: Arch | None) -> Plan:
        """``before``: the subnet of the step before this one (None: none). Its ops cannot move
        early, the others can (when there is a second stage to move them to)."""
        active = self.graph.active_ops(arch)
        previous = {op.op_id: owners[op.op_id] for op in active}
        busy = (frozenset(op.op_id for op in self.graph.active_ops(before))
                if before is not None and self._early_transport is not None else None)
        part = self.planner.plan(self._problem(active), previous, busy)
        h = hashlib.sha256(f"{arch.to_json()}|{list(part.bounds)}".encode()).digest()
        return Plan(arch, part, cut(active, part.bounds, self.graph.output), int.from_bytes(h[:7], "little"))

    def _key(self, arch: Arch, owners: Mapping[str, int], before: Arch | None) -> tuple:
        # A plan depends only on the arch, on where its active ops sit now and on the step before.
        return arch, before, tuple(owners[op.op_id] for op in self.graph.active_ops(arch))

    def _planned(self, arch: Arch, owners: Mapping[str, int], before: Arch | None) -> Plan:
        """The plan made ahead for this arch, placement and step before, else a fresh one."""
        return self._ahead.get(self._key(arch, owners, before)) or self._plan_with(arch, owners, before)

    def plan(self, arch: Arch) -> Plan:
        """The partition of ``arch`` given where ops sit now (pure: no messages, no side
        effects): the plan whose early moves are under way if it is for ``arch``, else a plan
        made ahead for this placement, else a fresh one."""
        if self._ahead_job is not None:
            self._ahead_job.result()  # started a step ago: done by now; re-raises its error if any
            self._ahead_job = None
        if self._committed is not None and self._committed.arch == arch:
            return self._committed
        return self._planned(arch, self.owners, self._last_arch)

    def _take_plan(self, arch: Arch) -> Plan:
        """:meth:`plan`, then forget the plans that were made for this step."""
        t0 = time.perf_counter()
        key = self._key(arch, self.owners, self._last_arch)
        self.stats.planned_ahead = ((self._committed is not None and self._committed.arch == arch)
                                    or key in self._ahead)
        plan = self.plan(arch)
        self._committed = None
        self._ahead.pop(key, None)
        self.stats.plan_s = time.perf_counter() - t0
        self.stats.bounds = plan.partition.bounds
        return plan

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """The subnets that follow the next ``train_step``'s (the sampler's lookahead). Once that
        step's migration has fixed where ops sit, they are planned in a background thread while
        the step computes, so planning stays off the critical path. A hint only: a plan that was
        not made ahead is made when needed, and the result is the same either way."""
        self._upcoming = list(archs)

    def _start_planning_ahead(self) -> None:
        if not self._upcoming or self.planner is None:
            return
        archs, owners, self._upcoming = self._upcoming, dict(self.owners), []
        self._ahead = {}
        nxt, before = self._committed, self._last_arch
        if nxt is not None and nxt.arch == archs[0]:
            # The next plan was made already (to start its early moves): chain on from it.
            owners.update(stages_of([op for sl in nxt.slices for op in sl.ops], nxt.partition.bounds))
            archs, before = archs[1:], nxt.arch

        def chain() -> None:
            prior = before
            for arch in archs:
                key = self._key(arch, owners, prior)
                plan = self._plan_with(arch, owners, prior)
                self._ahead[key] = plan
                active = [op for sl in plan.slices for op in sl.ops]
                owners.update(stages_of(active, plan.partition.bounds))
                prior = arch

        self._ahead_job = self._ahead_pool.submit(chain)

    def _agree(self, plan: Plan) -> None:
        if not self.settings.check_agreement or self.world_size == 1:
            return
        t = torch.tensor([plan.digest, -plan.digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != plan.digest or int(t[1]) != -plan.digest:
            raise RuntimeError(
                f"ranks disagree on the subnet or its partition (this rank: arch {plan.arch.digest()}, "
                f"bounds {list(plan.partition.bounds)}); every rank must sample the same arch stream "
                "and use the same cost profile"
            )

    # -- migration -------------------------------------------------------------------------
    def _migrate(self, plan: Plan) -> list[Move]:
        """Move each op whose stage changed, with its optimizer state, point to point."""
        todo = moves([op for sl in plan.slices for op in sl.ops], plan.partition.bounds, self.owners)
        sent_bytes = 0
        for mv in todo:
            if mv.src == self.rank:
                sent_bytes += self.transport.send_state(mv.op_id, self.tensors.export(mv.op_id), mv.dst)
            elif mv.dst == self.rank:
                self.tensors.adopt(mv.op_id, self.transport.recv_state(mv.op_id, mv.src))
            self.owners[mv.op_id] = mv.dst
        self.transport.flush()
        self.stats.migrated_ops = len(todo)
        self.stats.migrated_bytes = sent_bytes
        return todo

    def _start_early_moves(self, current: Plan) -> None:
        """Start moving, in the background, the ops the next subnet needs elsewhere that this
        step does not use (their state cannot change before the next step)."""
        if self._early_transport is None or not self._upcoming:
            return
        # as a rule made ahead a step ago, in the background (plan() waited for that chain)
        nxt = self._planned(self._upcoming[0], self.owners, current.arch)
        busy = {op.op_id for sl in current.slices for op in sl.ops}
        early = [mv for mv in moves([op for sl in nxt.slices for op in sl.ops], nxt.partition.bounds, self.owners)
                 if mv.op_id not in busy]
        self._committed = nxt
        if not early:
            return
        outgoing = {mv.op_id: self.tensors.export(mv.op_id) for mv in early if mv.src == self.rank}
        transport, rank = self._early_transport, self.rank

        def run() -> dict[str, dict[str, torch.Tensor]]:
            received = {}
            for mv in early:
                if mv.src == rank:
                    transport.send_state(mv.op_id, outgoing[mv.op_id], mv.dst)
                elif mv.dst == rank:
                    received[mv.op_id] = transport.recv_state(mv.op_id, mv.src)
            transport.flush()
            return received

        self._early_moves = early
        self._early_job = self._early_pool.submit(run)

    def _settle_early_moves(self) -> int:
        """Finish the background moves: adopt what arrived; every rank updates the owners."""
        if self._early_job is None:
            return 0
        job, self._early_job = self._early_job, None
        received = job.result()  # re-raises a failed transfer
        for mv in self._early_moves:
            if mv.dst == self.rank:
                self.tensors.adopt(mv.op_id, received[mv.op_id])
            self.owners[mv.op_id] = mv.dst
        n, self._early_moves = len(self._early_moves), []
        return n

    # -- training --------------------------------------------------------------------------
    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        batch = x.shape[0]
        mbs = split_batch(x.to(self.device), y.to(self.device), self.microbatches)
        with self.failures.failing(step, "migrate-ahead"):
            early = self._settle_early_moves()
        with self.failures.failing(step, "plan"):
            self._ensure_costs(x, batch // self.microbatches)
            plan = self._take_plan(arch)
            self._agree(plan)
        with self.failures.failing(step, "migrate"):
            self._migrate(plan)
            self._last_arch = arch
            self.stats.early_migrated_ops = early
            self._start_early_moves(plan)
            self._start_planning_ahead()
        mine = plan.slices[self.rank]
        runs: dict[int, SliceRun] = {}
        head_grads: dict[int, list] = {}
        losses = torch.zeros(self.microbatches, dtype=torch.float64)
        busy, peak = 0.0, 0
        for action in self.schedule.actions[self.rank]:
            with self.failures.failing(step, action):
                m = action.microbatch
                if action.kind == "F":
                    inputs = [mbs[m][0]] if self.rank == 0 else self.transport.recv(self.rank - 1)[0]
                    a0 = time.perf_counter()
                    run = SliceRun(mine, self.tensors.module, _ctx(self.seed, step, m, True))
                    outs = run.forward(inputs)
                    runs[m] = run
                    peak = max(peak, len(runs))
                    if self.rank == self.last:
                        loss, g = loss_and_grad(outs[0], mbs[m][1], batch)
                        losses[m] = loss.item()
                        head_grads[m] = [g]
                    busy += time.perf_counter() - a0
                    if self.rank != self.last:
                        self.transport.send(outs, self.rank + 1)
                else:
                    grads = head_grads.pop(m) if self.rank == self.last else self.transport.recv(self.rank + 1)[0]
                    a0 = time.perf_counter()
                    in_grads = runs.pop(m).backward(grads)
                    busy += time.perf_counter() - a0
                    if self.rank != 0:
                        self.transport.send(in_grads, self.rank - 1)
        with self.failures.failing(step, "optimizer"):
            self.transport.flush()
            a0 = time.perf_counter()
            self.tensors.step([op.op_id for op in mine.ops], self.lr(step))
            busy += time.perf_counter() - a0
            if self.last != 0:
                if self.rank == self.last:
                    self.transport.send([losses], 0)
                    self.transport.flush()
                elif self.rank == 0:
                    losses = self.transport.recv(self.last)[0][0]
        wall = time.perf_counter() - t0
        self.stats.wall_s, self.stats.busy_s, self.stats.max_in_flight = wall, busy, peak
        mb_losses = tuple(float(v) for v in losses.tolist()) if self.is_main else ()
        return StepResult(step, arch, float(sum(mb_losses)) if self.is_main else float("nan"), mb_losses, wall,
                          self.stats.migrated_ops + self.stats.early_migrated_ops, self.stats.migrated_bytes)

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        calib = [(x.to(self.device), y) for x, y in calib_batches] if graph_has_batchnorm(self.graph) else []
        if not batches:
            return EvalResult(float("nan"), 0, 0)
        with self.failures.failing(-1, "migrate-ahead"):
            self._settle_early_moves()
        with self.failures.failing(-1, "plan"):
            self._ensure_costs(batches[0][0], batches[0][0].shape[0])
            plan = self._take_plan(arch)
            self._agree(plan)
        with self.failures.failing(-1, "migrate"):
            self._migrate(plan)
        mine = plan.slices[self.rank]
        totals = torch.zeros(3, dtype=torch.float64)
        with recalibrated_bn([self.tensors.module(op.op_id) for op in mine.ops] if calib else []):
            self._forward_stream(mine, calib, True, None)

            def score(out: torch.Tensor, y: torch.Tensor) -> None:
                totals[0] += classification_loss(out, y, 1).item()
                totals[1] += int((out.argmax(-1) == y).sum())
                totals[2] += int(y.shape[0])

            self._forward_stream(mine, batches, False, score)
        with self.failures.failing(-1, "result"):
            totals = totals.to(self.device)
            dist.broadcast(totals, src=self.last)
        loss_sum, correct, total = totals.cpu().tolist()
        return EvalResult(loss_sum / max(total, 1), int(correct), int(total))

    def _forward_stream(self, mine: Slice, batches: list, training: bool, on_output) -> None:
        schedule = forward_only(self.num_stages, len(batches)) if batches else None
        if schedule is None:
            return
        for action in schedule.actions[self.rank]:
            with self.failures.failing(-1, action):
                m = action.microbatch
                inputs = [batches[m][0]] if self.rank == 0 else self.transport.recv(self.rank - 1)[0]
                outs = SliceRun(mine, self.tensors.module, _ctx(self.seed, -1, m, training)).forward(inputs, grad=False)
                if self.rank == self.last:
                    if on_output is not None:
                        on_output(outs[0], batches[m][1])
                else:
                    self.transport.send(outs, self.rank + 1)
        self.transport.flush()

    # -- state -----------------------------------------------------------------------------
    def op_states(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Gather every op's flat state on rank 0 (collective)."""
        with self.failures.failing(-1, "gather"):
            self._settle_early_moves()
            out: dict[str, dict[str, torch.Tensor]] = {}
            for op_id in sorted(self.owners):
                owner = self.owners[op_id]
                if owner == self.rank:
                    state = self.tensors.export(op_id, release=False)
                    if self.rank == 0:
                        out[op_id] = {k: v.detach().cpu().clone() for k, v in state.items()}
                    else:
                        self.transport.send_state(op_id, state, 0)
                elif self.rank == 0:
                    out[op_id] = {k: t.cpu() for k, t in self.transport.recv_state(op_id, owner).items()}
            self.transport.flush()
        return out if self.rank == 0 else None

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the state of the ops this rank owns with ``states`` (every rank passes all)."""
        self._settle_early_moves()
        for op_id in self.tensors.owned():
            self.tensors.export(op_id)
            self.tensors.adopt(op_id, states[op_id])

    def close(self) -> None:
        """Orderly teardown: after a clean run all ranks meet at a barrier before the process
        group goes (no rank tears down links a peer still uses); after a failure, no waiting."""
        self._ahead_pool.shutdown(wait=not self.failures.failed, cancel_futures=True)
        if not self.failures.failed:
            self._settle_early_moves()
        self._early_pool.shutdown(wait=not self.failures.failed, cancel_futures=True)
        if dist.is_initialized():
            if not self.failures.failed:
                dist.barrier()
            dist.destroy_process_group()


def _ctx(seed: int, step: int, mb: int, training: bool):
    return lambda op_id: OpContext(seed, step, mb, op_id, training)
