"""The lookahead planner: the plan of each step, the plans made ahead, and their cache.

A plan depends only on the arch, on where its active ops sit and on the subnet of the step
before (whose ops cannot move early), so every rank computes the same plan without messages.
From the sampler's lookahead, the next subnets are planned in a background thread while the
current step computes, wire specs (:mod:`pipeline.wire`) included; a plan not made ahead is
made when needed, and the result is the same either way.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from supernet import Arch, Slice, SupernetGraph, build_op, cut

from .memory.sizing import MemoryModel, arena_error, check_fits
from .plan.activations import ActivationError
from .plan.admission import SubnetWork, in_flight_bound
from .plan.costs import CostTable, analytic_costs, mean_problem, subnet_problem
from .plan.overhead import RuntimeCosts, subnet_work
from .plan.partition import Partition, PartitionError, PartitionProblem, kept_per_microbatch, stage_work
from .plan.placement import stages_of
from .plan.planners import StaticPlanner, make_planner
from .plan.schedule import Schedule, build as build_schedule
from .settings import PipelineSettings
from .shared import stateful_ops
from .wire import MetaModules, WireSpecs, wire_specs

__all__ = ["Plan", "LookaheadPlanner"]


@dataclass(frozen=True)
class Plan:
    """Where one subnet runs: its partition, each stage's slice, each stage's activation choice
    per op (``activations``; None: every op keeps them), and what crosses each cut for
    micro-batches of shape ``sample`` (``wires``; None: not known, messages describe themselves)."""

    arch: Arch
    partition: Partition
    slices: tuple[Slice, ...]
    digest: int
    activations: tuple[Mapping[str, str], ...] | None = None
    sample: tuple[tuple[int, ...], torch.dtype] | None = None
    wires: WireSpecs | None = None
    work: SubnetWork | None = None  # the estimated per-stage times and op uses a cross-subnet schedule is built from
    # why no activation plan fits memory.activation_budget_bytes: raised only when the subnet is
    # trained (an evaluation keeps no activations, so a subnet the search scores never needs one)
    activation_error: str | None = None
    # per stage, the activation bytes one micro-batch keeps there between its forward and
    # backward (its ops' saved tensors and the stage's input, from the cost table)
    kept: tuple[int, ...] = ()

    def stage_activations(self, stage: int) -> Mapping[str, str] | None:
        """Stage ``stage``'s activation choice per op for training (None: every op keeps them)."""
        if self.activation_error is not None:
            raise ActivationError(self.activation_error)
        return self.activations[stage] if self.activations else None

    @property
    def active(self) -> list:
        return [op for sl in self.slices for op in sl.ops]


class LookaheadPlanner:
    def __init__(self, graph: SupernetGraph, seed: int, num_stages: int, microbatches: int,
                 settings: PipelineSettings, costs: CostTable | None, can_move_early: bool, optim_name: str,
                 memory: MemoryModel | None = None, schedule: Schedule | None = None,
                 runtime: RuntimeCosts | None = None, replicas: int = 1) -> None:
        # ``costs``: the table to plan with (every rank the same); None: the analytic model at
        # the first batch's shape, with ``optim_name``'s optimizer state in the memory model.
        # ``runtime``: what a step costs beyond its ops on this machine (pipeline/calibrate.py;
        # None: the settings' link and nothing more): the link every split is priced with, and the
        # work a cross-subnet schedule is admitted by (actions, updates, ``replicas``' reduction)
        # ``memory``: the tensor manager's arenas and the activation policy (None: all resident)
        self.graph, self.seed, self.num_stages, self.microbatches = graph, seed, num_stages, microbatches
        self.memory = memory
        self.optim_name = optim_name
        # the step's schedule (the partitioner prices a split with it) and, with several subnets
        # in flight, the activations each stage may hold across them
        self.schedule = schedule if schedule is not None else build_schedule(settings.schedule, num_stages, microbatches)
        self.in_flight = (in_flight_bound(num_stages, microbatches, settings.window, settings.split_backward)
                          if settings.cross else None)
        self.settings, self.costs, self.can_move_early = settings, costs, can_move_early
        self.runtime, self.replicas = runtime, replicas
        self.planner = None
        self.stateful = stateful_ops(graph)  # the ops whose order between subnets matters
        # Wire specs come from a dry run of the stages on the meta device, ~30-70 ms of Python a
        # subnet on this machine's CPU: more than a step of the default space. A flushed step's
        # segment is prepared a step ahead and hides it; a cross-subnet segment plans tens at once,
        # and its executor receives each channel in sending order anyway, so its messages
        # describe themselves (a 512-byte header each) instead
        self.wires = not settings.cross
        self.sample: tuple[tuple[int, ...], torch.dtype] | None = None  # one training micro-batch
        specs = {slot.op_id: slot.spec for slot in graph.slots()}
        self._meta = MetaModules(lambda op_id: build_op(specs[op_id], op_id, seed, seeded=False))
        # plans and wire specs are pure functions of their keys: memoised (a subnet that comes
        # back with the same placement costs neither a solve nor a dry run)
        self._memo: OrderedDict[tuple, Plan] = OrderedDict()
        self._wires: OrderedDict[tuple, WireSpecs | None] = OrderedDict()

    # -- set-up ----------------------------------------------------------------------------
    def ensure(self, x: torch.Tensor, microbatch: int, training: bool) -> None:
        """Costs and planner from the first batch; the training micro-batch's shape."""
        if self.costs is None:
            self.costs = analytic_costs(self.graph, tuple(x.shape[1:]), microbatch, self.optim_name)
        if self.planner is None:
            self.planner = self._make_planner()
        if training:
            self.sample = ((microbatch, *x.shape[1:]), x.dtype)

    def _make_planner(self):
        s = self.settings
        if s.planner == "dynamic":
            return make_planner("dynamic", eps=s.eps, objective=s.objective,
                                move_latency=s.link_latency_s + s.migration_overhead_s)
        if s.planner == "static":
            return StaticPlanner.from_problem(mean_problem(
                self.graph, self.costs, num_stages=self.num_stages, num_microbatches=self.microbatches,
                schedule=self.schedule, in_flight=self.in_flight, bandwidth=s.link_bandwidth, latency=s.link_latency_s,
                memory_budget=s.budgets(self.num_stages)))  # the arena's bound is checked per plan
        return make_planner(s.planner)

    # -- plans -----------------------------------------------------------------------------
    def plan_with(self, arch: Arch, owners: Mapping[str, int], before: Arch | None, wires: bool = True) -> Plan:
        """The plan (pure; memoised). ``before``: the subnet of the step before (its ops cannot
        move early). ``wires`` false: without wire specs (only the placement is wanted; their dry
        run is the costly part of a plan)."""
        key = self.key(arch, owners, before)
        hit = self._memo.get(key)
        if hit is None:
            hit = _remember(self._memo, key, self._solve(arch, owners, before))
        return self.with_wires(hit) if wires else hit

    def problem(self, arch: Arch) -> PartitionProblem:
        """The partition problem of ``arch``'s active ops: the costs, schedule, link and memory
        model every plan of it is made with (pure)."""
        s, mm = self.settings, self.memory
        arena = mm is not None and mm.arena_bytes is not None
        bandwidth, latency = ((self.runtime.bandwidth, self.runtime.latency_s) if self.runtime is not None
                              else (s.link_bandwidth, s.link_latency_s))
        return subnet_problem(self.graph, self.graph.active_ops(arch), self.costs, self.num_stages, self.microbatches,
                              self.schedule, bandwidth, latency,
                              mm.budgets() if arena else s.budgets(self.num_stages), mm.managed if arena else None,
                              self.in_flight)

    def _solve(self, arch: Arch, owners: Mapping[str, int], before: Arch | None) -> Plan:
        s = self.settings
        active = self.graph.active_ops(arch)
        previous = {op.op_id: owners[op.op_id] for op in active}
        busy = (frozenset(op.op_id for op in self.graph.active_ops(before))
                if before is not None and self.can_move_early else None)
        mm = self.memory
        arena = mm is not None and mm.arena_bytes is not None
        problem = self.problem(arch)
        try:
            part = self.planner.plan(problem, previous, busy)
        except PartitionError as e:
            if not arena or e.closest is None:
                raise
            raise arena_error(mm, e.closest, f"no split of subnet {arch.to_json()} over {self.num_stages} stages "
                                             f"fits; the closest") from None
        if arena:
            check_fits(mm, part, f"the {s.planner} planner's split of subnet {arch.to_json()}")
        acts, refused = None, None
        try:
            acts = mm.activation_choices(problem, part.bounds) if mm is not None else None
        except ActivationError as e:
            refused = str(e)
        h = hashlib.sha256(f"{arch.to_json()}|{list(part.bounds)}".encode()).digest()
        slices = cut(active, part.bounds, self.graph.output)
        return Plan(arch, part, slices, int.from_bytes(h[:7], "little"), acts, work=self._work(problem, part, slices),
                    activation_error=refused, kept=kept_per_microbatch(problem, part.bounds))

    def _work(self, problem, part: Partition, slices: Sequence[Slice]) -> SubnetWork:
        """What a cross-subnet schedule needs of this plan: each stage's ops with state and the
        estimated seconds of its forward, backward and sends (pure, from the cost table)."""
        uses = tuple(frozenset(op.op_id for op in sl.ops) & self.stateful for sl in slices)
        if self.runtime is not None:
            return subnet_work(problem, part.bounds, uses, self.runtime, self.replicas, self.settings.reduce,
                               self_describing=not self.wires)
        fwd, bwd, send = stage_work(problem, part.bounds)
        return SubnetWork(uses, fwd, bwd, send)

    def move_seconds(self) -> dict[str, float]:
        """Per op: the estimated seconds its move between stages takes (weights and optimizer
        state on the link, plus the fixed cost per move)."""
        s = self.settings
        return {op_id: (c.param_bytes + c.optim_bytes) / s.link_bandwidth + s.link_latency_s + s.migration_overhead_s
                for op_id, c in self.costs.ops.items()}

    def with_wires(self, plan: Plan) -> Plan:
        """``plan`` with the wire specs of the current training micro-batch shape (none with
        cross-subnet schedules: their messages describe themselves, see ``self.wires``)."""
        if self.sample is None or plan.sample == self.sample or not self.wires:
            return plan
        key = (plan.arch, plan.partition.bounds, self.sample)
        if key in self._wires:
            wires = self._wires[key]
        else:
            shape, dtype = self.sample
            wires = wire_specs(plan.slices, self._meta, shape, dtype, self.seed) if self.num_stages > 1 else None
            _remember(self._wires, key, wires)
        return dataclasses.replace(plan, sample=self.sample, wires=wires)

    def key(self, arch: Arch, owners: Mapping[str, int], before: Arch | None) -> tuple:
        return arch, before, tuple(owners[op.op_id] for op in self.graph.active_ops(arch))

    def placed(self, plan: Plan) -> dict[str, int]:
        """Where ``plan`` leaves the ops that move: only ops with state, since an op without
        state runs wherever it is needed (a local instance) and never moves in training."""
        where = stages_of(plan.active, plan.partition.bounds)
        return {op: s for op, s in where.items() if op in self.stateful}

    def chain(self, archs: Sequence[Arch], owners: dict[str, int], prior: Arch | None) -> Iterator[tuple[tuple, Plan]]:
        """The plans of ``archs`` in training order, with their keys: each made where the plan
        before leaves the ops (``owners``, updated in place) after the subnet before (``prior``),
        as the engine trains them one after another (pure; memoised)."""
        for arch in archs:
            key = self.key(arch, owners, prior)
            plan = self.plan_with(arch, owners, prior)
            yield key, plan
            owners.update(self.placed(plan))
            prior = arch


_MEMO = 256


def _remember(memo: OrderedDict, key: tuple, value):
    memo[key] = value
    if len(memo) > _MEMO:
        memo.popitem(last=False)
    return value
