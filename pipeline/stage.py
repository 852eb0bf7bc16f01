"""The stage executor: one rank's action list for one training step (receive, compute, send).

Messages are payload only when the plan's wire specs are known (:mod:`pipeline.wire`): the
receive of the next action that needs input is posted before the current action computes, so
its data arrives meanwhile (on NCCL it is posted in one batch with the current action's sends);
sends complete lazily (:class:`pipeline.transport.Transport`). Losses stay on the device; the
last stage hands them to every rank in one message after its last action: no host
synchronisation between the first and the last action. Without wire specs the messages
describe themselves.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from supernet import Slice, SliceRun, classification_loss, op_contexts
from supernet.activations import ActivationPolicy

from .failures import FailureReporter
from .plan.schedule import Action, Schedule
from .trace import Tracer
from .transport import PostedRecv, Transport
from .wire import TensorSpec, WireSpecs

__all__ = ["StageExecutor", "StageRun"]


@dataclass
class StageRun:
    """What one step on this stage measured."""

    busy_s: float = 0.0  # compute (forward, backward)
    wait_s: float = 0.0  # waiting for receives
    max_in_flight: int = 0


class StageExecutor:
    def __init__(self, rank: int, schedule: Schedule, transport: Transport, failures: FailureReporter,
                 tracer: Tracer, device: torch.device, seed: int, offset: int = 0) -> None:
        self.rank, self.schedule, self.transport = rank, schedule, transport
        self.offset = offset  # the global index of this replica's first micro-batch (contexts use it)
        self.failures, self.tracer, self.device, self.seed = failures, tracer, device, seed
        self.last = schedule.num_stages - 1
        self.actions = schedule.actions[rank]
        # which actions read a message, and from which stage: the schedule's wait rule says
        rule = schedule.rule
        self._from = {i: w.action.stage for i, a in enumerate(self.actions) for w in rule.waits(a)
                      if w.message in ("activation", "gradient")}
        self._needs = sorted(self._from)

    def run(self, step: int, sl: Slice, wires: WireSpecs | None, mbs: Sequence[tuple[torch.Tensor, torch.Tensor]],
            batch: int, module: Callable[[str], nn.Module],
            policy: ActivationPolicy | None = None) -> tuple[torch.Tensor | None, StageRun]:
        """Run the step's actions; returns the micro-batch losses (a device tensor on every rank,
        read by the caller after the step: every rank decides alike whether to update) and this
        stage's figures."""
        rank, last, tr, tracer = self.rank, self.last, self.transport, self.tracer
        M = len(mbs)
        stats = StageRun()
        losses = torch.zeros(M, dtype=torch.float64, device=self.device) if rank == last else None
        posted: dict[int, PostedRecv] = {}
        needs, k = self._needs, 0  # needs[k]: the next action that reads a message
        eager = not tr.batched
        # every rank gets the losses from the last rank at the end of the step; on the channel
        # that also carries the last rank's gradients (rank last-1) the receive is posted after
        # theirs, in sending order
        loss_recv: list[PostedRecv] = []
        losses_after = needs[-1] if (rank == last - 1 and needs) else None

        def post_losses() -> None:
            loss_recv.append(tr.post_recv(last, (TensorSpec((M,), torch.float64),)))

        def posted_now(j: int, handle: PostedRecv) -> None:
            posted[j] = handle
            if j == losses_after:
                post_losses()

        def source(j: int) -> tuple[int, tuple]:
            """Where action ``j``'s message comes from, and what it carries."""
            if self.actions[j].kind == "F":
                return self._from[j], wires.forward[rank] if wires is not None else ()
            return self._from[j], wires.backward[rank] if wires is not None else ()

        def post(j: int) -> None:
            posted_now(j, tr.post_recv(*source(j)))

        with self.failures.failing(step, f"recv {self.actions[needs[0]]}" if needs else "recv"):
            # the first receives are posted before any action: a peer gone by now is this step's failure
            if wires is not None and rank != last and losses_after is None:
                post_losses()
            if wires is not None and needs:
                post(needs[0])
        runs: dict[int, SliceRun] = {}
        head_losses: dict[int, torch.Tensor] = {}
        for i, action in enumerate(self.actions):
            with self.failures.failing(step, action), tracer.span(step, str(action), action_cat(action)):
                m = action.microbatch
                reads = k < len(needs) and needs[k] == i
                if reads:
                    k += 1
                    if wires is not None and eager and k < len(needs):
                        post(needs[k])  # the next message arrives while this action computes
                    if wires is not None and i not in posted:
                        post(i)
                    w0 = time.perf_counter()
                    with tracer.span(step, f"recv {action}", "recv-wait"):
                        got = posted.pop(i).wait() if wires is not None else tr.recv(source(i)[0])[0]
                    stats.wait_s += time.perf_counter() - w0
                a0 = time.perf_counter()
                if action.kind == "F":
                    run = SliceRun(sl, module, op_contexts(self.seed, step, m + self.offset, True), policy)
                    outs = run.forward([mbs[m][0]] if rank == 0 else got)
                    runs[m] = run
                    stats.max_in_flight = max(stats.max_in_flight, len(runs))
                    if rank == last:  # the loss joins the slice's graph: one backward call later
                        loss = classification_loss(outs[0], mbs[m][1], batch)
                        losses[m] = loss.detach()
                        head_losses[m] = loss
                    out, dst = (outs, rank + 1) if rank != last else (None, None)
                else:
                    run = runs.pop(m)
                    in_grads = run.backward_loss(head_losses.pop(m)) if rank == last else run.backward(got)
                    out, dst = (in_grads, rank - 1) if rank != 0 else (None, None)
                stats.busy_s += time.perf_counter() - a0
                # NCCL: the receive of the very next action goes in one batch with this one's
                # sends (posting it earlier would queue it in front of sends its answer needs)
                nxt = (source(i + 1) if wires is not None and not eager and k < len(needs) and needs[k] == i + 1
                       and needs[k] not in posted else None)
                if out is not None or nxt is not None:
                    with tracer.span(step, f"send {action}", "send"):
                        if wires is None:
                            tr.send(out, dst)
                        else:
                            handle = tr.exchange(((out, dst),) if out is not None else (), nxt)
                            if nxt is not None:
                                posted_now(needs[k], handle)
        with self.failures.failing(step, "losses"):
            if rank == last:
                for dst in range(last):
                    if wires is not None:
                        tr.send_payload([losses], dst)
                    else:
                        tr.send([losses], dst)
            elif loss_recv:
                losses = loss_recv[0].wait()[0]
            else:
                losses = tr.recv(last)[0][0]
            tr.flush()
        return losses, stats


def action_cat(action: Action) -> str:
    return "forward" if action.kind == "F" else "backward"
