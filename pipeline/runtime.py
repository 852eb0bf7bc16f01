"""The pipelined engine: one process per stage, a new partition and live migration per subnet.

Every rank runs the same program on the same data and never asks another rank what to do. The
engine ties four parts together, one concern each:

* :class:`pipeline.lookahead.LookaheadPlanner`: the plan of each step (pure code, no
  messages), the plans made ahead from the sampler's lookahead and what crosses each cut;
* :class:`pipeline.migration.Migrator`: ops whose stage changes move with their optimizer
  state, now or during the step before;
* :class:`pipeline.stage.StageExecutor`: this rank's actions of the schedule (receive,
  compute, send), payload-only messages with receives posted ahead;
* :class:`pipeline.agreement.Agreement`: all ranks planned the same subnet and partition,
  checked a step ahead for plans made ahead (no round trip on the critical path).

Gradients accumulate in ascending micro-batch order on every stage, exactly as in the
reference, so the result is bit-identical. Every phase runs under
:class:`pipeline.failures.FailureReporter` (rank, step and action of any failure) and every wait
has a timeout: no hang.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from supernet import Arch, SupernetGraph

from .agreement import Agreement, AgreementError
from .evaluation import evaluate_stage
from .engine import (EvalResult, LrSchedule, StepResult, activation_policy, graph_has_batchnorm, split_batch,
                     update)
from .failures import FailureReporter, StageFailure, parse_fault
from .lookahead import LookaheadPlanner, Plan
from .memory_plan import MemoryModel
from .migration import Migrator
from .plan.costs import CostTable
from .plan.placement import initial_owners
from .plan.schedule import Schedule, build as build_schedule, validate
from .rendezvous import init_process_group
from .settings import DistEnv, PipelineSettings
from .stage import StageExecutor
from .memory_settings import MemorySettings
from .tensors import OptimConfig, TensorManager
from .trace import Span, Tracer
from .transport import Transport

__all__ = ["PipelineEngine", "StageFailure", "Plan", "AgreementError"]

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What this rank measured in its last step (for benchmarks and tests)."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    max_in_flight: int = 0
    migrated_ops: int = 0
    migrated_bytes: int = 0
    migration_s: float = 0.0  # the migration on the critical path
    wait_s: float = 0.0  # waiting for the schedule's messages
    plan_s: float = 0.0  # planning time on the critical path (near zero when planned ahead)
    early_migrated_ops: int = 0  # ops that moved during the previous step, off the critical path
    planned_ahead: bool = False
    bounds: tuple[int, ...] = ()  # the partition of the last step (or evaluation)
    swapped_bytes: int = 0  # activations swapped to host memory (memory.activations)
    recomputed_ops: int = 0  # op forwards whose activations were recomputed in the backward


class PipelineEngine:
    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int, lr: LrSchedule,
                 settings: PipelineSettings, env: DistEnv, device: torch.device,
                 failure_dir: str | os.PathLike | None = None, costs: CostTable | None = None,
                 trace_steps: Iterable[int] = (), memory: MemorySettings | None = None) -> None:
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
            init_process_group(backend, env.rank, env.world_size, settings.timeout_s)  # restart-safe under torchrun
        timeout = settings.timeout_s
        many = env.world_size > 1
        # Separate groups are separate channels: migration, gathers and evaluation (default
        # group), the schedule's payload-only messages, moves ahead, and the agreement check.
        self.transport = Transport(self.rank, self.device, timeout)
        self._schedule_transport = Transport(self.rank, self.device, timeout, group=dist.new_group()) if many else self.transport
        early = Transport(self.rank, self.device, timeout, group=dist.new_group()) if many else None
        self.agreement = Agreement(self.device, timeout, settings.check_agreement, dist.new_group() if many else None)
        self.schedule: Schedule = build_schedule(settings.schedule, self.num_stages, microbatches)
        validate(self.schedule)
        self.owners = initial_owners(graph.slots(), self.num_stages)
        # ``memory``: with a device budget this stage's ops live in host memory behind a bounded
        # device arena, fetched ahead from the plans of the coming steps (pipeline/tensors.py)
        self.tensors = TensorManager(graph, seed, optim, self.device,
                                     own=[op for op, s in self.owners.items() if s == self.rank], memory=memory)
        self.stats = StepStats()
        fd = failure_dir if failure_dir is not None else os.environ.get("PIPENAS_FAILURE_DIR")
        self.failures = FailureReporter(self.rank, self.schedule, Path(fd) if fd else None,
                                        parse_fault(os.environ.get("PIPENAS_FAULT")))
        self.tracer = Tracer(self.rank, trace_steps)
        self.planner = LookaheadPlanner(graph, seed, self.num_stages, microbatches, settings, costs,
                                        can_move_early=early is not None, optim_name=optim.name,
                                        memory=self._memory_model())
        self.migrator = Migrator(self.rank, self.owners, self.tensors, self.transport, early)
        self.stage = StageExecutor(self.rank, self.schedule, self._schedule_transport, self.failures, self.tracer,
                                   self.device, seed)
        self._last_arch: Arch | None = None  # the subnet of the last training step

    def _memory_model(self) -> MemoryModel:
        """The planner's view of the memory settings: every stage's arena capacity (gathered:
        a fraction of free device memory differs between devices) and each op's bytes there."""
        if not self.tensors.virtual:
            return MemoryModel(self.tensors.memory)
        with self.failures.failing(-1, "plan"):
            arenas: list = [None] * self.world_size
            dist.all_gather_object(arenas, self.tensors.stats().budget_bytes)
        footprint = self.tensors.footprints(slot.op_id for slot in self.graph.slots())
        return MemoryModel(self.tensors.memory, tuple(int(b) for b in arenas), footprint)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> int:
        return self.num_stages - 1

    @property
    def costs(self) -> CostTable | None:
        return self.planner.costs

    # -- planning --------------------------------------------------------------------------
    def plan(self, arch: Arch) -> Plan:
        """The partition of ``arch`` given where ops sit now (pure: no messages, no side effects)."""
        return self.planner.plan(arch, self.owners, self._last_arch)

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """The subnets that follow the next ``train_step``'s (the sampler's lookahead): planned
        in the background while that step computes. A hint only: the result is the same either way."""
        self.planner.set_upcoming(archs)

    def _take_plan(self, step: int, arch: Arch, checked: Plan | None) -> Plan:
        t0 = time.perf_counter()
        with self.tracer.span(step, "plan", "plan"):
            plan, ahead = self.planner.take(arch, self.owners, self._last_arch)
            self.agreement.check(plan, checked)
        self.stats.planned_ahead = ahead
        self.stats.plan_s = time.perf_counter() - t0
        self.stats.bounds = plan.partition.bounds
        return plan

    # -- migration -------------------------------------------------------------------------
    def _migrate(self, step: int, plan: Plan) -> None:
        t0 = time.perf_counter()
        with self.tracer.span(step, "migrate", "migrate"):
            moved = self.migrator.now(plan.active, plan.partition.bounds)
        self.stats.migrated_ops, self.stats.migrated_bytes = moved.ops, moved.bytes
        self.stats.migration_s = time.perf_counter() - t0

    def _prepare_next(self, current: Plan) -> None:
        """Fix the next step's plan (made ahead a step ago, in the background), start its check
        and the moves that can go now, plan the subnets after it, and tell the tensor manager
        which of this stage's ops the step and the next one use."""
        upcoming = self.planner.upcoming
        mine = [frozenset(op.op_id for op in current.slices[self.rank].ops)]
        if upcoming and self.migrator.early_transport is not None:
            nxt = self.planner.planned(upcoming[0], self.owners, current.arch)
            self.planner.committed = nxt
            self.agreement.post(nxt)
            self.migrator.start_ahead(nxt.active, nxt.partition.bounds, (op.op_id for op in current.active))
            mine.append(frozenset(op.op_id for op in nxt.slices[self.rank].ops))
        self.tensors.prefetch(mine)  # ops this rank does not own (yet) are ignored
        self.tensors.ensure(mine[0])
        self.planner.start_ahead(self.owners, self._last_arch)

    # -- training --------------------------------------------------------------------------
    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        batch = x.shape[0]
        mbs = split_batch(x.to(self.device), y.to(self.device), self.microbatches)
        with self.failures.failing(step, "plan"):
            checked = self.agreement.read()  # before the moves made ahead settle
        with self.failures.failing(step, "migrate-ahead"), self.tracer.span(step, "settle moves", "migrate-ahead"):
            early = self.migrator.settle()
        with self.failures.failing(step, "plan"):
            self.planner.ensure(x, batch // self.microbatches, training=True)
            plan = self._take_plan(step, arch, checked)
        with self.failures.failing(step, "migrate"):
            self._migrate(step, plan)
            self._last_arch = arch
            self.stats.early_migrated_ops = early
            self._prepare_next(plan)
        mine = plan.slices[self.rank]
        policy = activation_policy(plan.activations[self.rank] if plan.activations else None)
        losses, run = self.stage.run(step, mine, plan.wires, mbs, batch, self.tensors.module, policy)
        mb_losses = tuple(losses.tolist())  # the step's one host read, after its last action
        with self.failures.failing(step, "optimizer"), self.tracer.span(step, "optimizer", "optimizer"):
            a0 = time.perf_counter()
            update(self.tensors, [op.op_id for op in mine.ops], self.lr(step), mb_losses)
            memory = self.tensors.release_step()
            opt_s = time.perf_counter() - a0
        wall = time.perf_counter() - t0
        st = self.stats
        st.wall_s, st.busy_s, st.max_in_flight, st.wait_s = wall, run.busy_s + opt_s, run.max_in_flight, run.wait_s
        st.swapped_bytes, st.recomputed_ops = (policy.swapped_bytes, policy.recomputed_ops) if policy else (0, 0)
        return StepResult(step, arch, float(sum(mb_losses)), mb_losses, wall,
                          st.migrated_ops + st.early_migrated_ops, st.migrated_bytes, memory=memory,
                          migration_s=st.migration_s)

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        calib = [(x.to(self.device), y) for x, y in calib_batches] if graph_has_batchnorm(self.graph) else []
        if not batches:
            return EvalResult(float("nan"), 0, 0)
        with self.failures.failing(-1, "plan"):
            checked = self.agreement.read()
        with self.failures.failing(-1, "migrate-ahead"):
            self.migrator.settle()
        with self.failures.failing(-1, "plan"):
            self.planner.ensure(batches[0][0], batches[0][0].shape[0], training=False)
            plan = self._take_plan(-1, arch, checked)
        with self.failures.failing(-1, "migrate"):
            self._migrate(-1, plan)
        mine = plan.slices[self.rank]
        self.tensors.ensure([op.op_id for op in mine.ops])
        try:
            return evaluate_stage(mine, self.rank, self.num_stages, self.seed, self.tensors.module,
                                  self.transport, self.failures, batches, calib, self.device)
        finally:
            self.tensors.release_step(advance=False)

    # -- state -----------------------------------------------------------------------------
    def op_states(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Gather every op's flat state on rank 0 (collective)."""
        with self.failures.failing(-1, "gather"):
            self.migrator.settle()
            return self.migrator.gather()

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the state of the ops this rank owns with ``states`` (every rank passes all)."""
        self.migrator.settle()
        for op_id in self.tensors.owned():
            self.tensors.export(op_id)
            self.tensors.adopt(op_id, states[op_id])

    def trace_spans(self) -> list[Span] | None:
        """Every rank's recorded spans on rank 0 (collective); None on the others."""
        with self.failures.failing(-1, "trace"):
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, self.tracer.spans)
        return [sp for spans in gathered for sp in spans] if self.rank == 0 else None

    def close(self) -> None:
        """Orderly teardown: after a clean run all ranks meet at a barrier before the process
        group goes (no rank tears down links a peer still uses); after a failure, no waiting."""
        ok = not self.failures.failed
        self.planner.close(wait=ok)
        if ok:
            self.agreement.read()
        self.migrator.close(wait=ok)
        self.tensors.close()
        if dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


