"""The cross-subnet stage executor: one rank's actions of a schedule with several subnets in flight.

The schedule (:mod:`pipeline.plan.admission`) lists forwards, backwards and one update per
(subnet, stage); :class:`~pipeline.plan.schedule.WaitRule` says what each action waits for and
what each action sends. This executor only follows it:

* every message another stage sends this one arrives on its channel in sending order
  (activations, gradients and losses on the schedule's channel; op states on their own); the
  executor receives a channel in that order, keeping what comes before it is needed, so stages
  may run subnets in different orders (a later subnet overtaking a blocked one);
* a forward of subnet ``t`` reads its ops as the rule says: an op that moves arrives (and is
  adopted) before the subnet's first forward here; shared ops come from :class:`SharedOps`;
* an update ``U`` steps the subnet's ops on this stage, once its micro-batch losses are here
  (the last stage sends them to every stage at its own update); a loss that is not finite skips
  it, on every stage alike; then the ops the next user needs elsewhere leave.

Gradients of one subnet accumulate in ascending micro-batch order and no two subnets in flight
share an op with state except through the versions the rule names, so every op sees the same
updates, in the same order, with the same gradients as in the single-process reference.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from supernet import SliceRun, SupernetGraph, build_op, classification_loss, op_contexts

from .engine import activation_policy, update
from .failures import FailureReporter
from .lookahead import Plan
from .plan.schedule import Action, Schedule, Wait
from .shared import SharedOps
from .trace import Tracer
from .transport import Transport

__all__ = ["CrossExecutor", "CrossRun", "Segment"]

_CATEGORY = {"F": "forward", "B": "backward", "U": "optimizer"}  # an action's kind -> its trace category


@dataclass(frozen=True)
class Segment:
    """Subnets trained back to back without a flush: their steps, plans, batches and learning
    rates, and the schedule that interleaves them (local subnet ``t`` is ``steps[t]``)."""

    steps: tuple[int, ...]
    plans: tuple[Plan, ...]
    schedule: Schedule
    batches: tuple[Sequence[tuple[torch.Tensor, torch.Tensor]], ...]  # per subnet: its micro-batches
    batch_sizes: tuple[int, ...]
    lrs: tuple[float, ...]


@dataclass
class CrossRun:
    """What one segment measured on this stage."""

    busy_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    moved_bytes: list[int] = field(default_factory=list)  # per subnet: bytes this stage sent ahead of it
    max_in_flight: int = 0


class CrossExecutor:
    def __init__(self, rank: int, graph: SupernetGraph, tensors, shared: SharedOps, transport: Transport,
                 state_transport: Transport, failures: FailureReporter, tracer: Tracer, device: torch.device,
                 seed: int, reducer=None, offset: int = 0) -> None:
        self.rank, self.graph, self.tensors, self.shared = rank, graph, tensors, shared
        # replicated stages (pipeline/replicas.py): ``reducer`` folds the replicas' gradients at
        # each U action; ``offset`` is the global index of this replica's first micro-batch
        self.reducer, self.offset = reducer, offset
        self.transport, self.state_transport = transport, state_transport
        self.failures, self.tracer, self.device, self.seed = failures, tracer, device, seed
        self._specs = {slot.op_id: slot.spec for slot in graph.slots()}
        self._stateless: dict[str, nn.Module] = {}

    def _module(self, op: str, step: int) -> nn.Module:
        """The module subnet ``step`` runs for ``op``: this rank's (or a shared op's version);
        an op without state runs from a local instance wherever it is (nothing to move)."""
        if self.tensors.owns(op):
            m = self.shared.module(op, step)
            return self.reducer.watch(m) if self.reducer is not None else m
        m = self._stateless.get(op)
        if m is None:
            m = self._stateless[op] = build_op(self._specs[op], op, self.seed).to(self.device)
        return m

    def run(self, seg: Segment) -> tuple[list[tuple[float, ...]], CrossRun]:
        """Run this rank's actions of ``seg``; returns every subnet's micro-batch losses (on
        every rank) and this stage's figures."""
        with self.reducer.recorded() if self.reducer is not None else nullcontext():
            return self._run(seg)

    def _run(self, seg: Segment) -> tuple[list[tuple[float, ...]], CrossRun]:
        sch, me = seg.schedule, self.rank
        rule, P, M = sch.rule, sch.num_stages, sch.num_microbatches
        last = P - 1
        tr, st = self.transport, self.state_transport
        stats = CrossRun(moved_bytes=[0] * sch.num_subnets)
        for_subnet = {(mv.after, mv.op): mv.before.subnet for mv in rule.moves()}
        # what each peer sends this stage, in sending order, per channel
        queues: dict[int, deque[Wait]] = {}
        state_queues: dict[int, deque[Wait]] = {}
        for src in range(P):
            if src != me:
                channel = rule.channel(sch.actions, src, me)
                queues[src] = deque(w for w in channel if w.message != "state")
                state_queues[src] = deque(w for w in channel if w.message == "state")
        got: dict[Wait, object] = {}
        origin = dict(sch.origin or ())  # the stage each op with state starts the segment on

        def take(w: Wait, src: int, step: int) -> object:
            if w.message == "state":
                while w not in got:
                    nxt = state_queues[src].popleft()
                    state = st.recv_state(nxt.op, src)
                    self.tensors.adopt(nxt.op, state)
                    got[nxt] = True
                return got.pop(w)
            w0 = time.perf_counter()
            with self.tracer.span(step, f"recv {w.message}", "recv-wait"):
                while w not in got:
                    got[queues[src].popleft()] = tr.recv(src)[0]
            stats.wait_s += time.perf_counter() - w0
            return got.pop(w)

        def emit(a: Action | None, out: Sequence[torch.Tensor | None] | None, losses: torch.Tensor | None,
                 kinds: tuple[str, ...] = ("activation", "gradient", "losses", "state")) -> None:
            """Send what the rule says ``a`` sends (only the messages of ``kinds``)."""
            for dst, w in rule.sends(a, me):
                if w.message not in kinds:
                    continue
                if w.message == "state":
                    n = st.send_state(w.op, self.tensors.export(w.op), dst)
                    stats.moved_bytes[for_subnet[(a, w.op)]] += n
                    self.shared.drop(w.op)
                else:
                    tr.send([losses] if w.message == "losses" else out, dst)

        runs: dict[tuple[int, int], SliceRun] = {}
        head: dict[tuple[int, int], torch.Tensor] = {}
        losses = [torch.zeros(M, dtype=torch.float64, device=self.device) if me == last else None
                  for _ in seg.steps]
        values: list[tuple[float, ...] | None] = [None] * len(seg.steps)
        policies = [activation_policy(p.stage_activations(me)) for p in seg.plans]
        with self.failures.failing(seg.steps[0], "migrate"):
            emit(None, None, None)  # ops whose first use here is on another stage than their owner
        for a in sch.actions[me]:
            t, m = a.subnet, a.microbatch
            step, plan = seg.steps[t], seg.plans[t]
            shown = Action(a.stage, a.kind, a.microbatch)  # the step names the subnet
            cat = _CATEGORY[a.kind]
            with self.failures.failing(step, shown, mark=a), self.tracer.span(step, str(shown), cat):
                inputs = None
                for w in rule.waits(a):
                    if w.message is None or (w.action is not None and w.action.stage == me):
                        continue
                    src = w.action.stage if w.action is not None else origin[w.op]
                    value = take(w, src, step)
                    if w.message in ("activation", "gradient"):
                        inputs = value
                    elif w.message == "losses":
                        losses[t] = value[0]
                a0 = time.perf_counter()
                if a.kind == "F":
                    if m == 0:
                        for op in sorted(sch.uses[t][me]):
                            self.shared.begin(op, step)
                    run = SliceRun(plan.slices[me], lambda op, step=step: self._module(op, step),
                                   op_contexts(self.seed, step, m + self.offset, True), policies[t])
                    outs = run.forward([seg.batches[t][m][0]] if me == 0 else inputs)
                    runs[(t, m)] = run
                    stats.max_in_flight = max(stats.max_in_flight, len(runs))
                    out = None
                    if me == last:
                        loss = classification_loss(outs[0], seg.batches[t][m][1], seg.batch_sizes[t])
                        losses[t][m] = loss.detach()
                        head[(t, m)] = loss
                    else:
                        out = outs
                    stats.busy_s += time.perf_counter() - a0
                    emit(a, out, None)
                elif a.kind == "B":
                    run = runs.pop((t, m))
                    grads = run.backward_loss(head.pop((t, m))) if me == last else run.backward(inputs)
                    stats.busy_s += time.perf_counter() - a0
                    emit(a, grads if me > 0 else None, None)
                else:
                    emit(a, None, losses[t], kinds=("losses",))  # (last stage) every update needs them
                    # every replica's losses (with replicas), in micro-batch order
                    values[t] = self._update(sch.uses[t][me], step, seg.lrs[t], tuple(losses[t].tolist()))
                    stats.update_s += time.perf_counter() - a0
                    emit(a, None, None, kinds=("state",))  # then the ops the next user needs elsewhere leave
        with self.failures.failing(seg.steps[-1], "flush"):
            tr.flush()
            st.flush()
        return [v if v is not None else () for v in values], stats

    def _update(self, ops: frozenset[str], step: int, lr: float, mb_losses: Sequence[float]) -> tuple[float, ...]:
        """The optimizer step of one subnet's ops on this stage, unless a loss is not finite
        (:func:`pipeline.engine.update`: then only their gradients are dropped, other subnets in
        flight keep theirs); returns the micro-batch losses it decided on."""
        with self.shared.updating(sorted(ops), step) as stepped:
            if self.reducer is not None:
                with self.tracer.span(step, "reduce", "reduce"):
                    mb_losses = self.reducer.fold(mb_losses, [self.tensors.module(op) for op in stepped])
            update(self.tensors, stepped, lr, mb_losses)
        return tuple(mb_losses)
