"""Pipelined evaluation: forward-only micro-batches through the stages, the score on the last.

Evaluation is rare next to training and its batches may have any size, so its messages
describe themselves (:meth:`pipeline.transport.Transport.send`). Batch norm is recalibrated on
the calibration batches first (train-mode forwards), then restored afterwards; the last stage
sums loss, correct answers and count on the device and broadcasts them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from supernet import Slice, SliceRun, classification_loss, op_contexts

from .engine import EvalResult, recalibrated_bn
from .failures import FailureReporter
from .plan.schedule import forward_only
from .transport import Transport, peer_errors

__all__ = ["evaluate_stage"]


def evaluate_stage(mine: Slice, rank: int, num_stages: int, seed: int, module: Callable[[str], nn.Module],
                   transport: Transport, failures: FailureReporter, batches: list, calib: list,
                   device: torch.device) -> EvalResult:
    """This rank's part of the evaluation (collective over all stages)."""
    last = num_stages - 1

    def stream(batches: list, training: bool, on_output) -> None:
        if not batches:
            return
        for action in forward_only(num_stages, len(batches)).actions[rank]:
            with failures.failing(-1, action):
                m = action.microbatch
                inputs = [batches[m][0]] if rank == 0 else transport.recv(rank - 1)[0]
                outs = SliceRun(mine, module, op_contexts(seed, -1, m, training)).forward(inputs, grad=False)
                if rank == last:
                    if on_output is not None:
                        on_output(outs[0], batches[m][1])
                else:
                    transport.send(outs, rank + 1)
        transport.flush()

    totals = torch.zeros(3, dtype=torch.float64, device=device)

    def score(out: torch.Tensor, y: torch.Tensor) -> None:
        totals[0] += classification_loss(out, y, 1)
        totals[1] += (out.argmax(-1) == y).sum()
        totals[2] += y.shape[0]

    with recalibrated_bn([module(op.op_id) for op in mine.ops] if calib else []):
        stream(calib, True, None)
        stream(batches, False, score)
    with failures.failing(-1, "result"):
        src = transport.global_rank(last)
        with (peer_errors("receiving the evaluation's result from", src) if rank != last
              else peer_errors("sending the evaluation's result to the other stages")):
            dist.broadcast(totals, src=src, group=transport.group)  # within this replica
    loss_sum, correct, total = totals.cpu().tolist()
    return EvalResult(loss_sum / max(total, 1), int(correct), int(total))
