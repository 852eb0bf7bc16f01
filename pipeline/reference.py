"""The single-process reference engine: the computation the pipeline must reproduce bit for bit.

One process owns every op. Each step trains one subnet: the batch is split into M
micro-batches, each runs forward and backward through the whole subnet (one
:class:`supernet.execute.Slice`), gradients accumulate in micro-batch order, then every active
op takes one optimizer step. Ops outside the subnet get no gradient and are not updated.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from supernet import Arch, OpContext, SliceRun, SupernetGraph, classification_loss, cut, loss_and_grad

from .engine import EvalResult, LrSchedule, StepResult, graph_has_batchnorm, recalibrated_bn, split_batch
from .tensors import OptimConfig, TensorManager

__all__ = ["ReferenceEngine"]


class ReferenceEngine:
    rank = 0
    world_size = 1

    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig, microbatches: int,
                 lr: LrSchedule, device: torch.device | str = "cpu") -> None:
        self.graph = graph
        self.seed = seed
        self.microbatches = microbatches
        self.lr = lr
        self.device = torch.device(device)
        self.tensors = TensorManager(graph, seed, optim, self.device, own=[s.op_id for s in graph.slots()])

    @property
    def is_main(self) -> bool:
        return True

    def _slice(self, arch: Arch):
        active = self.graph.active_ops(arch)
        return cut(active, [0, len(active)], self.graph.output)[0]

    def _ctx(self, step: int, mb: int, training: bool):
        return lambda op_id: OpContext(self.seed, step, mb, op_id, training)

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """Nothing to plan: one process runs every op."""

    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        sl = self._slice(arch)
        batch = x.shape[0]
        losses = []
        for mb, (xm, ym) in enumerate(split_batch(x.to(self.device), y.to(self.device), self.microbatches)):
            run = SliceRun(sl, self.tensors.module, self._ctx(step, mb, True))
            (out,) = run.forward([xm])
            loss, grad = loss_and_grad(out, ym, batch)
            run.backward([grad])
            losses.append(loss.item())
        self.tensors.step([op.op_id for op in sl.ops], self.lr(step))
        return StepResult(step, arch, float(sum(losses)), tuple(losses), time.perf_counter() - t0)

    @torch.no_grad()
    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult:
        sl = self._slice(arch)
        modules = [self.tensors.module(op.op_id) for op in sl.ops]
        calib = list(calib_batches) if graph_has_batchnorm(self.graph) else []
        with recalibrated_bn(modules if calib else []):
            for mb, (xc, _) in enumerate(calib):
                SliceRun(sl, self.tensors.module, self._ctx(-1, mb, True)).forward([xc.to(self.device)], grad=False)
            loss_sum, correct, total = 0.0, 0, 0
            for mb, (xv, yv) in enumerate(batches):
                xv, yv = xv.to(self.device), yv.to(self.device)
                (out,) = SliceRun(sl, self.tensors.module, self._ctx(-1, mb, False)).forward([xv], grad=False)
                loss_sum += classification_loss(out, yv, 1).item()
                correct += int((out.argmax(-1) == yv).sum())
                total += int(yv.shape[0])
        return EvalResult(loss_sum / max(total, 1), correct, total)

    def op_states(self) -> dict[str, dict[str, torch.Tensor]]:
        return {op_id: self.tensors.export(op_id, release=False) for op_id in self.tensors.owned()}

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for op_id, state in states.items():
            if self.tensors.owns(op_id):
                self.tensors.export(op_id)  # drop the fresh copy
            self.tensors.adopt(op_id, state)

    def close(self) -> None:
        pass
