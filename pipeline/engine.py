"""What every training engine offers the search loop, and the pieces engines share.

Two engines implement :class:`Engine`: the single-process reference
(:class:`pipeline.reference.ReferenceEngine`) and the pipelined one
(:class:`pipeline.runtime.PipelineEngine`). The search loop talks only to this interface, so
one search code path serves one process and many. Every rank calls every method with the
same arguments, in the same order.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from supernet import Arch, Slice, SliceRun, SupernetGraph, build_op, classification_loss, op_contexts
from supernet.activations import ActivationPolicy

if TYPE_CHECKING:
    from .memory import MemoryStats

__all__ = [
    "StepResult", "EvalResult", "Engine", "LrSchedule", "recalibrated_bn", "graph_has_batchnorm",
    "split_batch", "update", "engine_device", "activation_policy", "StepInput", "lookahead", "step_by_step",
    "PLAN_AHEAD", "GradClip", "grad_sq_sums", "calibrate", "score_batches",
]

StepInput = tuple  # (step, arch, x, y): one training step handed to ``Engine.train_steps``
PLAN_AHEAD = 2  # subnets of the sampler's lookahead an engine plans (or fetches) in the background


def lookahead(items: Sequence[StepInput], i: int, upcoming: Sequence[Arch]) -> list[Arch]:
    """The subnets that follow ``items[i]``: the rest of ``items``, then ``upcoming``."""
    return ([it[1] for it in items[i + 1:]] + list(upcoming))[:PLAN_AHEAD]


def step_by_step(engine: Engine, items: Sequence[StepInput], upcoming: Sequence[Arch]) -> list[StepResult]:
    """``Engine.train_steps`` one flushed step at a time: each step announced with the subnets
    after it (``plan_ahead``), as the search loop did before segments."""
    out = []
    for i, (step, arch, x, y) in enumerate(items):
        engine.plan_ahead(lookahead(items, i, upcoming))
        out.append(engine.train_step(step, arch, x, y))
    return out


@dataclass(frozen=True)
class StepResult:
    """One training step. Every rank has the micro-batch losses (so every rank decides alike
    whether the step updated anything: it does not when a loss is not finite)."""

    step: int
    arch: Arch
    loss: float
    microbatch_losses: tuple[float, ...]
    seconds: float
    migrated_ops: int = 0
    migrated_bytes: int = 0
    memory: MemoryStats | None = None  # the tensor manager's counters for this step (this rank)
    migration_s: float = 0.0  # this rank's time moving ops on the step's critical path
    # this rank's saved activations (memory.activations): bytes swapped to host memory, op
    # forwards recomputed in the backward, bytes handed to the paired stage (the peer tier)
    swapped_bytes: int = 0
    recomputed_ops: int = 0
    peered_bytes: int = 0


@dataclass(frozen=True)
class EvalResult:
    """A forward-only evaluation of one subnet; the same values on every rank."""

    loss: float
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


class Engine(Protocol):
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def train_step(self, step: int, arch: Arch, x: torch.Tensor, y: torch.Tensor) -> StepResult: ...

    def input_rows(self, batch_size: int) -> range | None:
        """The rows of each training batch this rank computes on (a replica's micro-batches), or
        None for all of them. ``train_step(s)`` takes either the whole batch or just these rows."""

    def train_steps(self, items: Sequence[StepInput], upcoming: Sequence[Arch] = ()) -> list[StepResult]:
        """Train ``items`` (step, arch, x, y), in training order, several in flight where the
        engine can; returns one result per item. ``upcoming``: the subnets after them (a hint)."""

    def plan_ahead(self, archs: Sequence[Arch]) -> None:
        """A hint: the archs that follow the next ``train_step``'s (the sampler's lookahead)."""

    def evaluate(self, arch: Arch, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 calib_batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> EvalResult: ...

    def op_states(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Every op's flat state on the main rank (gathered), ``None`` on the others."""

    def load_op_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None: ...

    def trace_spans(self) -> list | None:
        """The spans of the traced steps, every rank's, on the main rank (collective); None elsewhere."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class LrSchedule:
    """Learning rate as a pure function of the step: constant or cosine, with linear warm-up."""

    base: float
    total_steps: int
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule: expected 'constant' or 'cosine', found {self.kind!r}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.base
        t = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.base - self.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def grad_sq_sums(modules: Sequence[nn.Module], device: torch.device) -> torch.Tensor:
    """Per op (``modules`` in op order), the sum of squares of its gradients in float64: per
    parameter ``torch.linalg.vector_norm(g, dtype=torch.float64).square()`` (accumulated in float64
    without a float64 copy of the gradient: a tenth of the time of ``g.double().pow(2).sum()``),
    added in the module's parameter order (no gradient: 0). Shape (n,), on ``device``."""
    out = []
    for m in modules:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for p in m.parameters():
            if p.grad is not None:
                total = total + torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
        out.append(total)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64, device=device)


@dataclass(frozen=True)
class GradClip:
    """``train.clip_grad_norm``: scale a subnet's gradients so that their global L2 norm is at
    most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule, ``scale = min(1, max_norm /
    (norm + 1e-6))``), the same float in every layout.

    The norm is the square root of a float64 sum, over the subnet's active ops in the graph's op
    order (``graph.active_ops(arch)``), of each op's sum of squares (:func:`grad_sq_sums`),
    added one by one on the host. A process holding only some ops (a pipeline stage) passes
    ``exchange``: it takes this process's per-op sums and returns the whole subnet's vector in
    op order, the same bits on every rank (the pipeline: the other stages' sums, which the
    schedule's ``norm`` messages brought). One process: no exchange."""

    max_norm: float

    def __post_init__(self) -> None:
        if not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"train.clip_grad_norm: expected a positive number or null, found {self.max_norm!r}")

    def __call__(self, modules: Sequence[nn.Module], device: torch.device,
                 exchange: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 sums: torch.Tensor | None = None) -> float:
        """Clip the gradients of ``modules`` (this process's ops of the subnet, in op order): each
        is replaced by its scaled copy, never scaled in place (with replicas on one host it may be
        a view of the shared sum every replica reads; the same bits as ``mul_``); returns the
        global norm before clipping. ``sums``: their
        :func:`grad_sq_sums`, when already taken (the gradients unchanged since)."""
        sums = grad_sq_sums(modules, device) if sums is None else sums
        total = 0.0
        for v in (exchange(sums) if exchange is not None else sums).tolist():  # op order, on every rank alike
            total += v
        norm = math.sqrt(total)
        scale = self.max_norm / (norm + 1e-6)
        if scale < 1.0:  # (a scale of 1 changes no bit)
            params = [p for m in modules for p in m.parameters() if p.grad is not None]
            # one fused out-of-place multiply (the bits of p.grad * scale; a sixth of its time here)
            for p, g in zip(params, torch._foreach_mul([p.grad for p in params], scale)):
                p.grad = g
        return norm


def update(tensors, op_ids: Sequence[str], lr: float, microbatch_losses: Sequence[float],
           clip: Callable[[Sequence[nn.Module]], float] | None = None) -> bool:
    """The optimizer step of ``op_ids``, unless a micro-batch loss is not finite: then the
    step's gradients are dropped and nothing changes (the caller stops or skips the step).
    ``clip``: called with the modules of ``op_ids`` (in op order) before the step, once the
    losses are known finite (every rank decides alike: a collective is safe there). Returns
    whether it updated."""
    if all(math.isfinite(v) for v in microbatch_losses):
        if clip is not None:
            clip([tensors.module(op) for op in op_ids])
        tensors.step(op_ids, lr)
        return True
    tensors.zero_grad(op_ids)
    return False


def activation_policy(choices: Mapping[str, str] | None, peer=None) -> ActivationPolicy | None:
    """The policy that runs a slice's ops under ``choices`` (op id -> keep | swap | recompute |
    peer, what :meth:`pipeline.memory.sizing.MemoryModel.activation_choices` planned; None: keep
    all). ``peer``: this stage's side of the peer tier (:class:`pipeline.memory.peer.PeerClient`;
    None: ``peer`` keeps)."""
    if not choices or all(c == "keep" for c in choices.values()):
        return None
    return ActivationPolicy(choices, peer=peer)


def policy_counts(policy: ActivationPolicy | None) -> dict[str, int]:
    """What ``policy`` did with a step's saved activations, as :class:`StepResult` counts them."""
    if policy is None:
        return {"swapped_bytes": 0, "recomputed_ops": 0, "peered_bytes": 0}
    return {"swapped_bytes": policy.swapped_bytes, "recomputed_ops": policy.recomputed_ops,
            "peered_bytes": policy.peered_bytes}


def split_batch(x: torch.Tensor, y: torch.Tensor, microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a batch into equal micro-batches (the config checks that they divide it)."""
    if x.shape[0] % microbatches:
        raise ValueError(
            f"train.microbatches: expected a divisor of the batch size {x.shape[0]}, found {microbatches}"
        )
    return list(zip(x.chunk(microbatches), y.chunk(microbatches)))


@lru_cache(maxsize=64)
def graph_has_batchnorm(graph: SupernetGraph) -> bool:
    """Whether any op of the supernet has batch norm (decided without building real weights,
    the same on every rank)."""
    with torch.device("meta"):
        for slot in graph.slots():
            if any(isinstance(m, _BatchNorm) for m in build_op(slot.spec, slot.op_id, 0).modules()):
                return True
    return False


def engine_device(name: str) -> torch.device:
    """The device ``create_engine`` runs on for the config's ``device`` (``auto``: CUDA when available)."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def calibrate(sl: Slice, module: Callable[[str], nn.Module], seed: int,
              calib: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One train-mode forward of ``sl`` per calibration batch, with the evaluation's op contexts
    (step -1): inside :func:`recalibrated_bn`, the subnet's batch-norm statistics as the search
    scores it (the engines and ``search.export`` alike)."""
    for mb, (xc, _) in enumerate(calib):
        SliceRun(sl, module, op_contexts(seed, -1, mb, True)).forward([xc], grad=False)


@torch.no_grad()
def score_batches(forward: Callable[[int, torch.Tensor], torch.Tensor],
                  batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> EvalResult:
    """Loss (mean per sample) and accuracy of ``forward(index, x) -> logits`` over ``batches``."""
    loss_sum, correct, total = 0.0, 0, 0
    for mb, (xv, yv) in enumerate(batches):
        out = forward(mb, xv)
        loss_sum += classification_loss(out, yv, 1).item()
        correct += int((out.argmax(-1) == yv).sum())
        total += int(yv.shape[0])
    return EvalResult(loss_sum / max(total, 1), correct, total)


@contextmanager
def recalibrated_bn(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Reset the batch-norm statistics of ``modules`` to a cumulative average for the duration
    (so forward passes in train mode recalibrate them for one subnet), then restore them.

    Searching with inherited weights must not disturb the supernet's trained statistics.
    """
    bns = [m for mod in modules for m in mod.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(bn, bn.momentum, {k: v.clone() for k, v in bn.named_buffers(recurse=False)}) for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    try:
        yield
    finally:
        with torch.no_grad():
            for bn, momentum, buffers in saved:
                bn.momentum = momentum
                for k, v in buffers.items():
                    getattr(bn, k).copy_(v)
