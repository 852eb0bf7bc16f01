"""The stage executor: one rank's actions of any validated schedule, one subnet or many in flight.

A flushed step is a one-subnet schedule with an update per stage (:func:`pipeline.plan.admission.sequential`);
a cross-subnet segment (:mod:`pipeline.plan.admission`) keeps several subnets in flight. Both
run here; :class:`~pipeline.plan.schedule.WaitRule` says what each action waits for and sends,
and this executor only follows it:

* every message another stage sends this one arrives on its channel in sending order
  (activations, gradients and losses on the schedule's channel; op states on their own); the
  executor receives a channel in that order, keeping what comes before it is needed, so stages
  may run subnets in different orders (a later subnet overtaking a blocked one);
* **payload only** when every plan of the segment knows its wire specs (:mod:`pipeline.wire`):
  each channel's next message is posted as soon as the one before it is taken, so it arrives
  while this stage computes (gloo); on NCCL, whose pair streams run in order, a receive is
  posted when it is needed (never in front of a send its answer needs). Without wire specs the
  messages describe themselves;
* a forward of subnet ``t`` reads its ops as the rule says: an op that moves arrives (and is
  adopted) before the subnet's first forward here; shared ops come from :class:`SharedOps`;
* **the tensor manager** (:class:`~pipeline.memory.TensorManager`) is told this stage's use
  order across the whole segment (the subnets by their first forward here: Belady sees the exact
  future), pins a subnet's ops from its first forward to its update and unpins them then (an op
  another subnet in flight still uses stays pinned); the admission builder bounded the ops
  pinned at once by the arena;
* an update ``U`` steps the subnet's ops on this stage, once its micro-batch losses are here
  (the last stage sends them to every stage at its own update); a loss that is not finite skips
  it, on every stage alike; then the ops the next user needs elsewhere leave. With clipping
  (``Schedule.norms``) each stage sends its ops' sums of squares of the subnet's gradients to
  every other stage after its last backward of the subnet, and the update clips with them.

Gradients of one subnet accumulate in ascending micro-batch order and no two subnets in flight
share an op with state except through the versions the rule names, so every op sees the same
updates, in the same order, with the same gradients as in the single-process reference.

An evaluation (:meth:`StageExecutor.evaluate`) runs the forward-only schedule
(:func:`~pipeline.plan.schedule.forward_only`) through the same executor: its batches may have
any size, so its messages describe themselves; batch norm is recalibrated on the calibration
batches first (train-mode forwards) and restored afterwards; the last stage sums loss, correct
answers and count on the device and broadcasts them. With replicas each replica's pipeline
evaluates its share of the batches, and the last stages combine one row per batch exactly
(:meth:`pipeline.replicas.ReplicaReducer.combine_rows`) before that sum.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from supernet import Slice, SliceRun, SupernetGraph, build_op, classification_loss, op_contexts

from .engine import EvalResult, activation_policy, grad_sq_sums, policy_counts, recalibrated_bn, update
from .failures import FailureReporter
from .lookahead import Plan
from .memory import MemoryStats
from .plan.schedule import Action, Schedule, Wait, forward_only
from .shared import SharedOps
from .trace import Tracer
from .transport import PostedRecv, Transport, peer_errors
from .wire import TensorSpec

__all__ = ["StageExecutor", "SegmentRun", "Segment"]

# an action's kind -> its trace category (a split backward's weight half is backward too)
_CATEGORY = {"F": "forward", "B": "backward", "W": "backward", "U": "optimizer"}


@dataclass(frozen=True)
class Segment:
    """Subnets trained back to back: their steps, plans, batches and learning rates, and the
    schedule that runs them (local subnet ``t`` is ``steps[t]``). ``after``: this stage's op
    sets of the subnets known to follow the segment (the tensor manager fetches toward them);
    ``tail``: the moves of the subnet after it that can travel while it runs."""

    steps: tuple[int, ...]
    plans: tuple[Plan, ...]
    schedule: Schedule
    batches: tuple[Sequence[tuple[torch.Tensor, torch.Tensor]], ...]  # per subnet: its micro-batches
    batch_sizes: tuple[int, ...]
    lrs: tuple[float, ...]
    after: tuple[frozenset[str], ...] = ()
    # (op, from stage, to stage): ops the subnet after the segment needs elsewhere and the segment
    # does not use; sent at its start, received (adopted) at its end, on the ops' channel
    tail: tuple[tuple[str, int, int], ...] = ()


@dataclass
class SegmentRun:
    """What one segment measured on this stage."""

    busy_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    moved_bytes: list[int] = field(default_factory=list)  # per subnet: bytes this stage sent ahead of it
    moved_wait_s: list[float] = field(default_factory=list)  # per subnet: waiting here for the ops it moved in
    memory: list[MemoryStats | None] = field(default_factory=list)  # per subnet: the tensor manager's counters
    max_in_flight: int = 0
    activations: list[dict[str, int]] = field(default_factory=list)  # per subnet: its policy's counts

    @property
    def swapped_bytes(self) -> int:
        return sum(a["swapped_bytes"] for a in self.activations)

    @property
    def recomputed_ops(self) -> int:
        return sum(a["recomputed_ops"] for a in self.activations)


# A stage's clipping for one subnet's update: (the other stages' sums of squares by stage, and this
# one's if it sent them; None: one stage) -> the clip callable, or None
Clipper = Callable[["dict[int, torch.Tensor] | None"], Callable | None]


class StageExecutor:
    def __init__(self, rank: int, graph: SupernetGraph, tensors, shared: SharedOps, transport: Transport,
                 state_transport: Transport, failures: FailureReporter, tracer: Tracer, device: torch.device,
                 seed: int, reducer=None, offset: int = 0, clipper: Clipper | None = None, peer=None) -> None:
        self.rank, self.graph, self.tensors, self.shared = rank, graph, tensors, shared
        self.peer = peer  # this stage's side of the peer tier (a giver's PeerClient; None: ``peer`` keeps)
        # replicated stages (pipeline/replicas.py): ``reducer`` folds the replicas' gradients at
        # each U action (clipping by messages: at the subnet's last backward here, before the sums
        # leave); ``offset`` is the global index of this replica's first micro-batch
        self.reducer, self.offset, self.clipper = reducer, offset, clipper
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

    def _updated(self, ops: frozenset[str], step: int) -> list[nn.Module]:
        """The modules subnet ``step``'s update here steps (``ops``: its ops on this stage), in order."""
        return [self._module(op, step) for op in sorted(ops)]

    def run(self, seg: Segment, between: Callable[[], None] | None = None) -> tuple[list[tuple[float, ...]], SegmentRun]:
        """Run this rank's actions of ``seg``; returns every subnet's micro-batch losses (on
        every rank) and this stage's figures. ``between``: called after each action (the
        engine posts the next segment's agreement check there once it is prepared)."""
        with self.reducer.recorded() if self.reducer is not None else nullcontext():
            return self._run(seg, between)

    def _run(self, seg: Segment, between: Callable[[], None] | None) -> tuple[list[tuple[float, ...]], SegmentRun]:
        sch, me = seg.schedule, self.rank
        rule, P, M = sch.rule, sch.num_stages, sch.num_microbatches
        last = P - 1
        tr, st = self.transport, self.state_transport
        row = sch.actions[me]
        T = sch.num_subnets
        stats = SegmentRun(moved_bytes=[0] * T, moved_wait_s=[0.0] * T, memory=[None] * T)
        for_subnet = {(mv.after, mv.op): mv.before.subnet for mv in rule.moves()}
        inbox = _Inbox(self, seg, stats)
        origin = dict(sch.origin or ())  # the stage each op with state starts the segment on

        def send_state(op: str, dst: int, subnet: int) -> None:
            stats.moved_bytes[subnet] += st.send_state(op, {**self.tensors.export(op), **self.shared.export_versions(op)},
                                                       dst)
            self.shared.drop(op)

        def emit(a: Action | None, out: Sequence[torch.Tensor | None] | None, losses: torch.Tensor | None,
                 kinds: tuple[str, ...] = ("activation", "gradient", "norm", "losses", "state"),
                 after: int = -1) -> None:
            """Send what the rule says ``a`` sends (only the messages of ``kinds``); on NCCL the
            receive that row action ``after`` needs first goes in the same batch."""
            payload, norm_to = [], []
            for dst, w in rule.sends(a, me):
                if w.message not in kinds:
                    continue
                if w.message == "state":
                    send_state(w.op, dst, for_subnet[(a, w.op)])
                elif w.message == "norm":
                    norm_to.append(dst)
                else:
                    payload.append(([losses] if w.message == "losses" else out, dst))
            nxt = row[after] if 0 <= after < len(row) else None
            if norm_to:  # the gradient leaves first; then the subnet's sums of squares here (now final)
                inbox.send(payload, None)
                t, step = a.subnet, seg.steps[a.subnet]
                if self.reducer is not None:  # the sums are of the replicas' sum: fold it now, not at U
                    self._fold(uses[t][me], step)
                norm = norms[t][me] = grad_sq_sums(self._updated(rule.stepped(t, me), step), self.device)
                payload = [([norm], dst) for dst in norm_to]
            inbox.send(payload, nxt)

        # the tensor manager: this stage's subnets in the order they begin here, each one's ops
        order = [a.subnet for a in row if a.kind == "F" and a.microbatch == 0]
        uses = sch.uses or tuple((frozenset(),) * P for _ in seg.steps)
        pending = list(order)  # subnets not yet updated here, in the manager's future order
        pinned: dict[int, frozenset[str]] = {}  # subnets in flight here -> their ops
        self.tensors.prefetch([uses[t][me] for t in order] + list(seg.after),
                              [_compute_s(seg.plans[t], me, M) for t in order])

        runs: dict[tuple[int, int], SliceRun] = {}
        weights: dict[tuple[int, int], SliceRun] = {}  # B done, W to come: the record stays
        head: dict[tuple[int, int], torch.Tensor] = {}
        losses = [torch.zeros(M, dtype=torch.float64, device=self.device) if me == last else None
                  for _ in seg.steps]
        values: list[tuple[float, ...] | None] = [None] * len(seg.steps)
        norms: list[dict[int, torch.Tensor]] = [{} for _ in seg.steps]  # per subnet and stage: clipping's sums
        policies = [activation_policy(p.stage_activations(me), self.peer) for p in seg.plans]
        with self.failures.failing(seg.steps[0], "migrate"):
            emit(None, None, None)  # ops whose first use here is on another stage than their owner
            for op, src, dst in seg.tail:  # then the next subnet's ops this segment does not use
                if src == me:
                    send_state(op, dst, T - 1)
        with self.failures.failing(seg.steps[0], "recv"):
            inbox.start()  # payload only: each channel's first receive is posted before any action
        for i, a in enumerate(row):
            t, m = a.subnet, a.microbatch
            step, plan = seg.steps[t], seg.plans[t]
            shown = Action(a.stage, a.kind, a.microbatch)  # the step names the subnet
            cat = _CATEGORY[a.kind]
            with self.failures.failing(step, shown, mark=a), self.tracer.span(step, str(shown), cat):
                nxt = row[i + 1] if i + 1 < len(row) else None
                if self.peer is not None and nxt is not None and nxt.kind == "B":
                    # the next backward's activations come back from the pair while this computes
                    self.peer.prefetch((seg.steps[nxt.subnet], nxt.microbatch + self.offset))
                inputs = None
                for w in rule.waits(a):
                    if w.message is None or (w.action is not None and w.action.stage == me):
                        continue
                    src = w.action.stage if w.action is not None else origin[w.op]
                    value = inbox.take(w, src, step, t)
                    if w.message in ("activation", "gradient"):
                        inputs = value
                    elif w.message == "losses":
                        losses[t] = value[0]
                    elif w.message == "norm":
                        norms[t][src] = value[0]
                a0 = time.perf_counter()
                if a.kind == "F":
                    if m == 0:
                        pinned[t] = uses[t][me]
                        self.tensors.ensure(uses[t][me])  # after the moves it waited for: owned by now
                        for op in sorted(uses[t][me]):
                            self.shared.begin(op, step)
                    run = SliceRun(plan.slices[me], lambda op, step=step: self._module(op, step),
                                   op_contexts(self.seed, step, m + self.offset, True), policies[t],
                                   split=(t, me) in sch.split)  # B the input gradients, W the weights' later
                    outs = run.forward([seg.batches[t][m][0]] if me == 0 else inputs)
                    runs[(t, m)] = run
                    stats.max_in_flight = max(stats.max_in_flight, len(runs) + len(weights))
                    out = None
                    if me == last:
                        loss = classification_loss(outs[0], seg.batches[t][m][1], seg.batch_sizes[t])
                        losses[t][m] = loss.detach()
                        head[(t, m)] = loss
                    else:
                        out = outs
                    stats.busy_s += time.perf_counter() - a0
                    emit(a, out, None, after=i + 1)
                    if self.reducer is not None and m == M - 1:  # this replica's batch-norm statistics are final
                        self.reducer.forwards_done(self._updated(uses[t][me], step))
                elif a.kind == "B":
                    run = runs.pop((t, m))
                    grads = run.backward_loss(head.pop((t, m))) if me == last else run.backward(inputs)
                    if run.split:
                        weights[(t, m)] = run
                    stats.busy_s += time.perf_counter() - a0
                    emit(a, grads if me > 0 else None, None, after=i + 1)
                elif a.kind == "W":
                    weights.pop((t, m)).backward_weight()  # in micro-batch order: the sum's order
                    stats.busy_s += time.perf_counter() - a0
                    emit(a, None, None, after=i + 1)  # sends nothing; posts the next receive
                else:
                    emit(a, None, losses[t], kinds=("losses",), after=i + 1)  # (last stage) every update needs them
                    # every replica's losses (with replicas), in micro-batch order
                    values[t] = self._update(sch.uses[t][me] if sch.uses else frozenset(), step, seg.lrs[t],
                                             losses[t], norms[t] if sch.norms else None)
                    ops = pinned.pop(t, frozenset())
                    still = frozenset().union(*pinned.values())  # ops another subnet in flight here runs
                    stats.memory[t] = self.tensors.release_step(ops=ops - still, done=pending.index(t),
                                                                in_flight=len(pinned))
                    pending.remove(t)
                    stats.update_s += time.perf_counter() - a0
                    emit(a, None, None, kinds=("state",))  # then the ops the next user needs elsewhere leave
            if between is not None:
                between()
        with self.failures.failing(seg.steps[-1], "migrate-ahead"):
            for op, src, dst in seg.tail:  # (adopted earlier if a later state message came first)
                if dst == me:
                    inbox.take(Wait(None, "state", op), src, seg.steps[-1], T - 1)
        with self.failures.failing(seg.steps[-1], "flush"):
            tr.flush()
            st.flush()
        stats.activations = [policy_counts(policy) for policy in policies]
        return [v if v is not None else () for v in values], stats

    @torch.no_grad()
    def evaluate(self, mine: Slice, num_stages: int, batches: list, calib: list, transport: Transport) -> EvalResult:
        """This stage's part of an evaluation of the slices ``mine`` belongs to (collective over
        the stages; the module doc): the live ops, the same result on every rank. ``transport``:
        the evaluation's channel (not the schedule's, whose next receives may be posted)."""
        last, me, tr, module = num_stages - 1, self.rank, transport, self.tensors.module

        def stream(batches: list, training: bool, on_output, index: Sequence[int]) -> None:
            """Forward ``batches`` (their indices among the evaluation's: ``index``) through the stages."""
            if not batches:
                return
            for action in forward_only(num_stages, len(batches)).actions[me]:
                with self.failures.failing(-1, action):
                    m = action.microbatch
                    inputs = [batches[m][0]] if me == 0 else tr.recv(me - 1)[0]
                    outs = SliceRun(mine, module, op_contexts(self.seed, -1, index[m], training)).forward(inputs, grad=False)
                    if me == last:
                        if on_output is not None:
                            on_output(m, outs[0], batches[m][1])
                    else:
                        tr.send(outs, me + 1)
            tr.flush()

        # with replicas each replica's pipeline scores its share of the batches (round-robin) and
        # the last stages exchange one row per batch: every batch's row comes from one replica,
        # -0.0 from the others (x + -0.0 is x for every x), so the sum is that row exactly; then
        # summed in batch order as one pipeline sums them (the same bits). Batch norm is
        # recalibrated on every replica alike.
        share = self.reducer.share(len(batches)) if self.reducer is not None else range(len(batches))
        rows = torch.full((len(batches), 3), -0.0, dtype=torch.float64, device=self.device)

        def score(m: int, out: torch.Tensor, y: torch.Tensor) -> None:
            rows[share[m], 0] = classification_loss(out, y, 1)
            rows[share[m], 1] = (out.argmax(-1) == y).sum()
            rows[share[m], 2] = y.shape[0]

        with recalibrated_bn([module(op.op_id) for op in mine.ops] if calib else []):
            stream(calib, True, None, range(len(calib)))
            stream([batches[i] for i in share], False, score, share)
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with self.failures.failing(-1, "result"):
            if me == last and self.reducer is not None:
                self.reducer.combine_rows(rows)
            for row in rows:  # (in batch order, as one pipeline adds them)
                totals += row
            src = tr.global_rank(last)
            with (peer_errors("receiving the evaluation's result from", src) if me != last
                  else peer_errors("sending the evaluation's result to the other stages")):
                dist.broadcast(totals, src=src, group=tr.group)  # within this replica
        loss_sum, correct, total = totals.cpu().tolist()
        return EvalResult(loss_sum / max(total, 1), int(correct), int(total))

    def _fold(self, ops: frozenset[str], step: int) -> None:
        """Ahead of the update (clipping by messages, with replicas): the replicas' gradients of
        the subnet's ops here, folded now and copied out of the reduction's shared memory (another
        subnet's fold may come before this one's update); the losses are gathered at the update."""
        with self.tracer.span(step, "reduce", "reduce"):
            self.reducer.reduce(self._updated(ops, step))
            self.reducer.own()

    def _update(self, ops: frozenset[str], step: int, lr: float, losses: torch.Tensor,
                norms: dict[int, torch.Tensor] | None = None) -> tuple[float, ...]:
        """The optimizer step of one subnet's ops on this stage, unless a loss is not finite
        (:func:`pipeline.engine.update`: then only their gradients are dropped, other subnets in
        flight keep theirs); returns the micro-batch losses it decided on. The subnet's one host
        read: its losses (on the device until here). With replicas the gradients are folded on
        the modules the subnet ran (a delayed op's private version) before they go to the live op.
        ``norms``: with clipping by messages (``Schedule.norms``), the stages' sums of squares by stage
        (this one's when it sent them: then its gradients were folded at that last backward,
        :meth:`_fold`, and only the losses are gathered here)."""
        mb_losses = tuple(losses.tolist())
        ordered = sorted(ops)
        if self.reducer is not None:
            folded = norms is not None and self.rank in norms  # (emit folds where it takes the sums)
            with self.tracer.span(step, "reduce", "reduce"):
                mb_losses = (self.reducer.gather_losses(mb_losses) if folded
                             else self.reducer.fold(mb_losses, self._updated(ops, step)))
        clip = self.clipper(norms) if self.clipper is not None else None
        with self.shared.updating(ordered, step) as stepped:
            update(self.tensors, stepped, lr, mb_losses, clip)
        if self.reducer is not None:
            self.reducer.released()  # (gradients the reduction left in shared memory: stepped or dropped now)
        return tuple(mb_losses)


class _Inbox:
    """The messages this stage receives from its peers in one segment, channel by channel in
    sending order; payload only (posted ahead) when every plan knows its wire specs."""

    def __init__(self, ex: StageExecutor, seg: Segment, stats: SegmentRun) -> None:
        sch, me = seg.schedule, ex.rank
        self.ex, self.seg, self.stats, self.me = ex, seg, stats, me
        self.tr, self.st = ex.transport, ex.state_transport
        self.wired = sch.num_stages > 1 and all(p.wires is not None for p in seg.plans)
        self.ahead = self.wired and not self.tr.batched  # NCCL: post at need (pair streams run in order)
        self.queues: dict[int, deque[Wait]] = {}
        self.state_queues: dict[int, deque[Wait]] = {}
        for src in range(sch.num_stages):
            if src != me:
                channel = sch.rule.channel(sch.actions, src, me)
                self.queues[src] = deque(w for w in channel if w.message != "state")
                # the ops' channel: the moves at the start, the tail's, then those after updates
                tail = [Wait(None, "state", op) for op, s, d in seg.tail if (s, d) == (src, me)]
                states = [w for w in channel if w.message == "state"]
                first = sum(1 for w in states if w.action is None)
                self.state_queues[src] = deque(states[:first] + tail + states[first:])
        self.got: dict[Wait, object] = {}
        self.posted: dict[int, PostedRecv] = {}  # per channel: its next message's receive, posted
        self.losses = (TensorSpec((sch.num_microbatches,), torch.float64),)
        self.rule = sch.rule

    def _specs(self, w: Wait) -> tuple:
        if w.message == "losses":
            return self.losses
        if w.message == "norm":  # one float64 sum of squares per op the sender steps
            return (TensorSpec((len(self.rule.stepped(w.action.subnet, w.action.stage)),), torch.float64),)
        wires = self.seg.plans[w.action.subnet].wires
        return wires.forward[self.me] if w.message == "activation" else wires.backward[self.me]

    def _post(self, src: int) -> None:
        if self.queues[src]:
            self.posted[src] = self.tr.post_recv(src, self._specs(self.queues[src][0]))

    def start(self) -> None:
        if self.ahead:
            for src in self.queues:
                self._post(src)

    def send(self, sends: list[tuple[Sequence[torch.Tensor | None], int]], nxt: Action | None) -> None:
        """Post ``sends`` ((tensors, destination stage)). On NCCL, whose pair streams run in
        order, the first message action ``nxt`` receives, when it is its channel's next and not
        yet posted, is posted in the same batch: it arrives while this stage computes, and no
        receive is queued in front of a send its answer needs."""
        if not self.wired:
            for tensors, dst in sends:
                self.tr.send(tensors, dst)
            return
        recv = self._next_recv(nxt) if self.tr.batched and nxt is not None else None
        if sends or recv is not None:
            handle = self.tr.exchange(sends, (recv, self._specs(self.queues[recv][0])) if recv is not None else None)
            if recv is not None:
                self.posted[recv] = handle

    def _next_recv(self, a: Action) -> int | None:
        """The channel whose next message ``a`` waits for first, if not posted yet."""
        for w in self.rule.waits(a):
            if w.message in ("activation", "gradient", "norm", "losses") and w.action.stage != self.me:
                src = w.action.stage
                q = self.queues[src]
                return src if q and q[0] == w and src not in self.posted else None
        return None

    def take(self, w: Wait, src: int, step: int, subnet: int) -> object:
        """The value of ``w`` from ``src`` for local subnet ``subnet`` (state: adopted),
        receiving what comes before it on its channel."""
        got = self.got
        if w.message == "state":
            w0 = time.perf_counter()
            with self.ex.tracer.span(step, f"recv state {w.op}", "migrate"):
                while w not in got:
                    nxt = self.state_queues[src].popleft()
                    self.ex.tensors.adopt(nxt.op, self.ex.shared.adopt_versions(nxt.op, self.st.recv_state(nxt.op, src)))
                    got[nxt] = True
            self.stats.moved_wait_s[subnet] += time.perf_counter() - w0
            return got.pop(w)
        w0 = time.perf_counter()
        with self.ex.tracer.span(step, f"recv {w.message}", "recv-wait"):
            while w not in got:
                nxt = self.queues[src].popleft()
                if not self.wired:
                    got[nxt] = self.tr.recv(src)[0]
                    continue
                handle = self.posted.pop(src, None) or self.tr.post_recv(src, self._specs(nxt))
                if self.ahead:
                    # the channel's next receive is posted before this one is waited for: it is
                    # ready when its message comes, which may be while this stage still waits
                    self._post(src)
                got[nxt] = handle.wait()
        self.stats.wait_s += time.perf_counter() - w0
        return got.pop(w)


def _compute_s(plan: Plan, stage: int, microbatches: int) -> float:
    """A subnet's estimated compute on ``stage`` (its ``microbatches`` forwards and backwards):
    what the tensor manager's host may step its ops in (``memory.host_update_rate``). A flushed
    step's plan has no cross-subnet work: its partition's per-micro-batch stage time then."""
    if plan.work is not None:
        return microbatches * (plan.work.fwd[stage] + plan.work.bwd[stage])
    return microbatches * plan.partition.stage_times[stage]
