"""The pipelined engine: one process per stage, a new partition and live migration per subnet.

Every rank runs the same program on the same data and never asks another rank what to do. The
engine ties four parts together, one concern each:

* :class:`pipeline.lookahead.LookaheadPlanner`: the plan of each step (pure code, no
  messages), the plans made ahead from the sampler's lookahead and what crosses each cut;
* :class:`pipeline.migration.Migrator`: ops whose stage changes move with their optimizer
  state, now or during the step before;
* :class:`pipeline.stage.StageExecutor`: this rank's actions of the schedule (receive,
  compute, send), payload-only messages with receives posted ahead;
* the agreement check: all ranks planned the same subnet and partition. For a plan made ahead
  its all-reduce runs during the step before, on a group of its own, and is only read at the
  step's start, before anything of the step moves: no round trip on the critical path.

Gradients accumulate in ascending micro-batch order on every stage, exactly as in the
reference, so the result is bit-identical. Every phase runs under
:class:`pipeline.failures.FailureReporter` (rank, step and action of any failure) and every wait
has a timeout: no hang.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from supernet import Arch, OpContext, Slice, SliceRun, SupernetGraph, classification_loss

from .engine import EvalResult, LrSchedule, StepResult, graph_has_batchnorm, recalibrated_bn, split_batch, update
from .failures import FailureReporter, StageFailure, parse_fault
from .lookahead import LookaheadPlanner, Plan
from .migration import Migrator
from .plan.costs import CostTable
from .plan.placement import initial_owners
from .plan.schedule import Schedule, build as build_schedule, forward_only, validate
from .settings import DistEnv, PipelineSettings
from .stage import StageExecutor
from .tensors import OptimConfig, TensorManager
from .trace import Span, Tracer
from .transport import Transport

__all__ = ["PipelineEngine", "StageFailure", "Plan", "AgreementError"]

log = logging.getLogger(__name__)


class AgreementError(RuntimeError):
    """The ranks planned different subnets or partitions."""


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


class PipelineEngine:
    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int, lr: LrSchedule,
                 settings: PipelineSettings, env: DistEnv, device: torch.device,
                 failure_dir: str | os.PathLike | None = None, costs: CostTable | None = None,
                 trace_steps: Iterable[int] = ()) -> None:
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
        timeout = settings.timeout_s
        many = env.world_size > 1
        # Separate groups are separate channels: migration, gathers and evaluation (default
        # group), the schedule's payload-only messages, moves ahead, and the agreement check.
        self.transport = Transport(self.rank, self.device, timeout)
        self._schedule_transport = Transport(self.rank, self.device, timeout, group=dist.new_group()) if many else self.transport
        early = Transport(self.rank, self.device, timeout, group=dist.new_group()) if many else None
        self._agree_group = dist.new_group() if many else None
        self._agreeing: tuple[dist.Work, torch.Tensor, Plan] | None = None
        self.schedule: Schedule = build_schedule(settings.schedule, self.num_stages, microbatches)
        validate(self.schedule)
        self.owners = initial_owners(graph.slots(), self.num_stages)
        self.tensors = TensorManager(graph, seed, optim, self.device,
                                     own=[op for op, s in self.owners.items() if s == self.rank])
        self.stats = StepStats()
        fd = failure_dir if failure_dir is not None else os.environ.get("PIPENAS_FAILURE_DIR")
        self.failures = FailureReporter(self.rank, self.schedule, Path(fd) if fd else None,
                                        parse_fault(os.environ.get("PIPENAS_FAULT")))
        self.tracer = Tracer(self.rank, trace_steps)
        self.planner = LookaheadPlanner(graph, seed, self.num_stages, microbatches, settings, costs,
                                        can_move_early=early is not None, optim_name=optim.name)
        self.migrator = Migrator(self.rank, self.owners, self.tensors, self.transport, early)
        self.stage = StageExecutor(self.rank, self.schedule, self._schedule_transport, self.failures, self.tracer,
                                   self.device, seed)
        self._last_arch: Arch | None = None  # the subnet of the last training step

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
            self._agree(plan, checked)
        self.stats.planned_ahead = ahead
        self.stats.plan_s = time.perf_counter() - t0
        self.stats.bounds = plan.partition.bounds
        return plan

    # -- agreement -------------------------------------------------------------------------
    def _post_agreement(self, plan: Plan) -> None:
        """Start the check of a plan made ahead; read at the start of the step that uses it."""
        if self.settings.check_agreement and self._agree_group is not None:
            t = torch.tensor([plan.digest, -plan.digest], dtype=torch.int64, device=self.device)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_group, async_op=True)
            self._agreeing = (work, t, plan)

    def _read_agreement(self) -> Plan | None:
        """Finish the check started a step ago (raises if the ranks disagreed); the plan it checked."""
        if self._agreeing is None:
            return None
        (work, t, plan), self._agreeing = self._agreeing, None
        if work.wait(self.transport.timeout) is False:
            raise AgreementError(f"the agreement check got no answer within {self.settings.timeout_s:g} s")
        self._compare(t, plan)
        return plan

    def _agree(self, plan: Plan, checked: Plan | None) -> None:
        """Check ``plan`` now unless the check started a step ago (``checked``) covered it."""
        if not self.settings.check_agreement or self._agree_group is None or (
                checked is not None and checked.digest == plan.digest):
            return
        t = torch.tensor([plan.digest, -plan.digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._agree_group)
        self._compare(t, plan)

    def _compare(self, t: torch.Tensor, plan: Plan) -> None:
        hi, neg_lo = t.tolist()
        if hi != plan.digest or -neg_lo != plan.digest:
            raise AgreementError(
                f"ranks disagree on the subnet or its partition (this rank: arch {plan.arch.digest()}, "
                f"bounds {list(plan.partition.bounds)}); every rank must sample the same arch stream "
                "and use the same cost profile"
            )

    # -- migration -------------------------------------------------------------------------
    def _migrate(self, step: int, plan: Plan) -> None:
        t0 = time.perf_counter()
        with self.tracer.span(step, "migrate", "migrate"):
            moved = self.migrator.now(plan.active, plan.partition.bounds)
        self.stats.migrated_ops, self.stats.migrated_bytes = moved.ops, moved.bytes
        self.stats.migration_s = time.perf_counter() - t0

    def _prepare_next(self, current: Plan) -> None:
        """Fix the next step's plan (made ahead a step ago, in the background), start its check
        and the moves that can go now, and plan the subnets after it."""
        upcoming = self.planner.upcoming
        if upcoming and self.migrator.early_transport is not None:
            nxt = self.planner.planned(upcoming[0], self.owners, current.arch)
            self.planner.committed = nxt
            self._post_agreement(nxt)
            self.migrator.start_ahead(nxt.active, nxt.partition.bounds, (op.op_id for op in current.active))
        self.planner.start_ahead(self.owners, self._last_arch)

    # -- training --------------------------------------------------------------------------
    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        batch = x.shape[0]
        mbs = split_batch(x.to(self.device), y.to(self.device), self.microbatches)
        with self.failures.failing(step, "plan"):
            checked = self._read_agreement()  # before the moves made ahead settle
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
        losses, run = self.stage.run(step, mine, plan.wires, mbs, batch, self.tensors.module)
        mb_losses = tuple(losses.tolist())  # the step's one host read, after its last action
        with self.failures.failing(step, "optimizer"), self.tracer.span(step, "optimizer", "optimizer"):
            a0 = time.perf_counter()
            update(self.tensors, [op.op_id for op in mine.ops], self.lr(step), mb_losses)
            opt_s = time.perf_counter() - a0
        wall = time.perf_counter() - t0
        st = self.stats
        st.wall_s, st.busy_s, st.max_in_flight, st.wait_s = wall, run.busy_s + opt_s, run.max_in_flight, run.wait_s
        return StepResult(step, arch, float(sum(mb_losses)), mb_losses, wall,
                          st.migrated_ops + st.early_migrated_ops, st.migrated_bytes)

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        calib = [(x.to(self.device), y) for x, y in calib_batches] if graph_has_batchnorm(self.graph) else []
        if not batches:
            return EvalResult(float("nan"), 0, 0)
        with self.failures.failing(-1, "plan"):
            checked = self._read_agreement()
        with self.failures.failing(-1, "migrate-ahead"):
            self.migrator.settle()
        with self.failures.failing(-1, "plan"):
            self.planner.ensure(batches[0][0], batches[0][0].shape[0], training=False)
            plan = self._take_plan(-1, arch, checked)
        with self.failures.failing(-1, "migrate"):
            self._migrate(-1, plan)
        mine = plan.slices[self.rank]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with recalibrated_bn([self.tensors.module(op.op_id) for op in mine.ops] if calib else []):
            self._forward_stream(mine, calib, True, None)

            def score(out: torch.Tensor, y: torch.Tensor) -> None:
                totals[0] += classification_loss(out, y, 1)
                totals[1] += (out.argmax(-1) == y).sum()
                totals[2] += y.shape[0]

            self._forward_stream(mine, batches, False, score)
        with self.failures.failing(-1, "result"):
            dist.broadcast(totals, src=self.last)
        loss_sum, correct, total = totals.cpu().tolist()
        return EvalResult(loss_sum / max(total, 1), int(correct), int(total))

    def _forward_stream(self, mine: Slice, batches: list, training: bool, on_output) -> None:
        """Forward-only micro-batches through the stages (evaluation; messages describe themselves)."""
        if not batches:
            return
        for action in forward_only(self.num_stages, len(batches)).actions[self.rank]:
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
            self.migrator.settle()
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
        if ok and self._agreeing is not None:
            self._read_agreement()
        self.migrator.close(wait=ok)
        if dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def _ctx(seed: int, step: int, mb: int, training: bool):
    return lambda op_id: OpContext(seed, step, mb, op_id, training)
