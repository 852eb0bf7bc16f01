"""The single-process reference engine: the computation the pipeline must reproduce bit for bit.

One process owns every op. Each step trains one subnet: the batch is split into M
micro-batches, each runs forward and backward through the whole subnet (one
:class:`supernet.execute.Slice`), gradients accumulate in micro-batch order, then every active
op takes one optimizer step. Ops outside the subnet get no gradient and are not updated.

With a device budget (``memory``) the tensor manager keeps ops in host memory: each step
announces its ops and the lookahead's (``plan_ahead``) so the next ones are fetched while this
one runs, pins its own (``ensure``) and releases them after the optimizer step. Its
activation policy (``memory.activations``) is planned as for a one-stage pipeline: one
micro-batch in flight, ``auto`` against ``memory.activation_budget_bytes``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from supernet import Arch, SliceRun, SupernetGraph, classification_loss, op_contexts
from supernet.execute import whole_slice

from .engine import (EvalResult, GradClip, LrSchedule, StepResult, activation_policy, calibrate, policy_counts,
                     graph_has_batchnorm, recalibrated_bn, score_batches, split_batch, step_by_step, update)
from .memory import MemoryModel, MemorySettings, OptimConfig, TensorManager
from .memory.sizing import check_largest_subnet
from .plan.costs import CostTable, analytic_costs, subnet_problem
from .plan.partition import PartitionProblem
from .plan.schedule import Schedule, one_f_one_b
from .shared import SharedOps, shared_ops_of
from .trace import Span, Tracer

__all__ = ["ReferenceEngine", "activation_problem"]


def activation_problem(graph: SupernetGraph, arch: Arch, costs: CostTable, microbatches: int,
                       schedule: Schedule | None = None) -> PartitionProblem:
    """What one process plans ``arch``'s activations on (``memory.activations``): one stage of
    all its active ops, one micro-batch in flight (``schedule``: 1F1B over one stage)."""
    schedule = schedule if schedule is not None else one_f_one_b(1, microbatches)
    return subnet_problem(graph, graph.active_ops(arch), costs, 1, microbatches, schedule, 1.0, 0.0)


class ReferenceEngine:
    rank = 0
    world_size = 1

    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int,
                 lr: LrSchedule, device: torch.device | str = "cpu", memory: MemorySettings | None = None,
                 trace_steps: Iterable[int] = (), shared_ops: str = "exact", shared_delay: int = 1,
                 checkpoint_every: int = 0, clip_grad_norm: float | None = None,
                 delay_compensation: tuple[str, float] = ("none", 1.0),
                 shared_delays: Mapping[str, int] | None = None) -> None:
        self.graph = graph
        # train.clip_grad_norm: the subnet's ops are all here, in op order (no exchange)
        self._clip = GradClip(clip_grad_norm) if clip_grad_norm is not None else None
        self.seed = seed
        self.microbatches = microbatches
        self.lr = lr
        self.device = torch.device(device)
        self.tensors = TensorManager(graph, seed, optim, self.device, memory=memory)
        if self.tensors.virtual:  # fail before building anything if the largest subnet cannot fit
            self._check_budget()
        for slot in graph.slots():
            self.tensors.create(slot.op_id)
        self._ahead: list[frozenset[str]] = []
        self.tracer = Tracer(0, trace_steps)
        self._model = MemoryModel(self.tensors.memory)
        self._costs: CostTable | None = None  # for memory.activations=auto, at the first batch's shape
        self._choices: dict[Arch, Mapping[str, str] | None] = {}
        self._schedule = one_f_one_b(1, microbatches)  # what one process runs: one micro-batch in flight
        # ops in every subnet: exact, read late or frozen, as the pipelined engine runs them
        # (``delay_compensation``: pipeline.delay_compensation and its coefficient, for delayed ones)
        self.shared = SharedOps(shared_ops, shared_delay, shared_ops_of(graph), checkpoint_every, self.tensors.module,
                                *delay_compensation, delays=shared_delays)

    @property
    def is_main(self) -> bool:
        return True

    def _slice(self, arch: Arch):
        return whole_slice(self.graph, arch)

    def _check_budget(self) -> None:
        """The largest subnet (the biggest candidate of every slot, and the fixed ops) must fit."""
        check_largest_subnet(self.graph, self.tensors.footprints(s.op_id for s in self.graph.slots()),
                             self.tensors.stats().budget_bytes)

    def input_rows(self, batch_size: int) -> range | None:
        return None  # one process computes every row

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """Remember the next subnets' ops: the next ``train_step`` hands them to the tensor
        manager with its own, which fetches them while that step runs."""
        self._ahead = [frozenset(op.op_id for op in self.graph.active_ops(a)) for a in archs]

    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        sl = self._slice(arch)
        ops = [op.op_id for op in sl.ops]
        self.tensors.prefetch([frozenset(ops), *self._ahead])
        self._ahead = []
        self.tensors.ensure(ops)
        batch = x.shape[0]
        losses = []
        span = self.tracer.span
        policy = self.last_policy = activation_policy(self._activation_choices(arch, x))
        for op in ops:
            self.shared.begin(op, step)
        module = lambda op: self.shared.module(op, step)  # noqa: E731 - the op as subnet ``step`` reads it
        for mb, (xm, ym) in enumerate(split_batch(x.to(self.device), y.to(self.device), self.microbatches)):
            run = SliceRun(sl, module, op_contexts(self.seed, step, mb, True), policy)
            with span(step, f"0F{mb}", "forward"):
                (out,) = run.forward([xm])
                loss = classification_loss(out, ym, batch)  # in the graph: one backward call
            with span(step, f"0B{mb}", "backward"):
                run.backward_loss(loss)
            losses.append(loss.item())
        with span(step, "optimizer", "optimizer"), self.shared.updating(ops, step) as stepped:
            clip = (lambda mods: self._clip(mods, self.device)) if self._clip is not None else None  # noqa: E731
            update(self.tensors, stepped, self.lr(step), losses, clip)  # nothing changes when a loss is not finite
        mem = self.tensors.release_step()
        return StepResult(step, arch, float(sum(losses)), tuple(losses), time.perf_counter() - t0, memory=mem,
                          **policy_counts(policy))

    def train_steps(self, items: Sequence[tuple[int, Arch, torch.Tensor, torch.Tensor]],
                    upcoming: Sequence[Arch] = ()) -> list[StepResult]:
        """Train ``items`` (step, arch, x, y) in order; ``upcoming``: the subnets after them."""
        return step_by_step(self, items, upcoming)

    def _activation_choices(self, arch: Arch, x: torch.Tensor) -> Mapping[str, str] | None:
        """``memory.activations`` for ``arch``'s ops (memoised per subnet; pure)."""
        if self._model.settings.activations == "keep":
            return None
        if arch not in self._choices:
            if self._costs is None:
                self._costs = analytic_costs(self.graph, tuple(x.shape[1:]), x.shape[0] // self.microbatches,
                                             self.tensors.optim.name)
            problem = activation_problem(self.graph, arch, self._costs, self.microbatches, self._schedule)
            if len(self._choices) >= 256:
                self._choices.clear()
            self._choices[arch] = self._model.activation_choices(problem, (0, problem.num_ops))[0]
        return self._choices[arch]

    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        sl = self._slice(arch)
        self.tensors.ensure([op.op_id for op in sl.ops])
        try:
            return self._evaluate(sl, batches, calib_batches)
        finally:
            self.tensors.release_step(advance=False)

    def _evaluate(self, sl, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> EvalResult:
        modules = [self.tensors.module(op.op_id) for op in sl.ops]
        calib = list(calib_batches) if graph_has_batchnorm(self.graph) else []
        with recalibrated_bn(modules if calib else []):
            calibrate(sl, self.tensors.module, self.seed, [(xc.to(self.device), y) for xc, y in calib])
            return score_batches(lambda mb, x: SliceRun(sl, self.tensors.module, op_contexts(self.seed, -1, mb, False))
                                 .forward([x], grad=False)[0],
                                 [(xv.to(self.device), yv.to(self.device)) for xv, yv in batches])

    def op_states(self) -> dict[str, dict[str, torch.Tensor]]:
        return {op_id: self.tensors.export(op_id, release=False) for op_id in self.tensors.owned()}

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the state of the ops in ``states`` (the others keep theirs; one without
        ``optim/`` entries gets a fresh optimizer)."""
        for op_id, state in states.items():
            if self.tensors.owns(op_id):
                self.tensors.export(op_id)  # drop the fresh copy
            self.tensors.adopt(op_id, state)

    def trace_spans(self) -> list[Span]:
        """The recorded spans (one process: all of them)."""
        return self.tracer.spans

    def close(self) -> None:
        self.tensors.close()
