"""Per-op optimizers: their settings, and one optimizer call that steps many ops at once.

Every op has its own optimizer, whose update is the same arithmetic whatever else a process
owns, and its state travels with it. SGD runs with ``foreach=False``; AdamW on the CPU with
torch's fused kernel (element by element within each tensor: one update of a transformer w256
subnet's 666 k parameters takes 0.68 ms on the 2-core VM against 1.67 ms with ``foreach=False``,
``bench/optim_step.py``), elsewhere with ``foreach=False``. On CUDA with the tensor manager, AdamW
runs as :class:`PortableAdamW`: the CPU's and the GPU's AdamW kernels round differently, and a
budgeted run updates some ops on the host (``memory.optimizer`` host or hybrid). A step of tens of ops through
tens of optimizer calls costs ~40 us of hooks and bookkeeping each, so :class:`OptimGroup`
steps them in one call over the same per-parameter state dicts.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import eager

__all__ = ["OptimConfig", "OptimGroup", "PortableAdamW", "correct_sqrt", "synthetic_update"]


@dataclass(frozen=True)
class OptimConfig:
    """Per-op optimizer settings. ``name`` is ``sgd`` or ``adamw``."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    nesterov: bool = False
    portable: bool = False  # AdamW as :class:`PortableAdamW` (the tensor manager's choice on CUDA)

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"train.optimizer.name: expected 'sgd' or 'adamw', found {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"train.optimizer.lr: expected a positive number, found {self.lr}")

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                                   nesterov=self.nesterov, foreach=False)
        if self.portable:
            return PortableAdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay)
        # the CPU's fused kernel (one call, per element); elsewhere foreach=False, whose bits
        # PortableAdamW reproduces (a budgeted CUDA run's host-side updates, bench/cuda_bits.py)
        cpu = all(p.device.type == "cpu" for p in params)
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, **({"fused": True} if cpu else {"foreach": False}))


class PortableAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay; torch.optim.AdamW's update and state) in operations that
    each round once: a multiply, an add, a divide or a square root per kernel, never a fused
    multiply-add (``lerp``, ``addcmul``, ``addcdiv``). IEEE rounds each of those alike on every
    device, so an update on the host gives the GPU's bits (bench/cuda_bits.py measured torch's
    AdamW apart: SGD's kernels agree, AdamW's fused ones do not). State: ``step`` (a host
    scalar), ``exp_avg`` and ``exp_avg_sq``, as torch's, so checkpoints and the tensor
    manager's slots are the same."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        # two scratch tensors per device and dtype, as large as the largest parameter stepped so
        # far: the update's temporaries land in them (the same operations, the same bits). Fresh
        # temporaries of a large parameter are fresh pages on the host: 1.9x slower at 4 M
        # parameters, 1.2x at 0.5 M (the 2-core VM). An instance steps on one thread at a time
        # (each host-update thread has its own, pipeline/memory/manager.py).
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _temporaries(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (p.device, p.dtype)
        bufs = self._scratch.get(key)
        if bufs is None or bufs[0].numel() < p.numel():
            bufs = self._scratch[key] = tuple(torch.empty(p.numel(), dtype=p.dtype, device=p.device) for _ in range(2))
        return tuple(b[: p.numel()].view(p.shape) for b in bufs)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = float(st["step"])
                m, v = st["exp_avg"], st["exp_avg_sq"]
                a, denom = self._temporaries(p)
                p.mul_(1 - lr * wd)
                m.mul_(b1).add_(torch.mul(g, 1 - b1, out=a))
                v.mul_(b2).add_(torch.mul(g, g, out=a).mul_(1 - b2))
                # measured on an H200 (bench/cuda_bits.py): CUDA divides a tensor by a scalar as a
                # multiply by its reciprocal and rounds its float sqrt apart from the CPU; so a
                # multiply by the reciprocal, and the correctly rounded square root
                correct_sqrt(v, out=denom).mul_(1 / math.sqrt(1 - b2 ** t)).add_(eps)
                p.sub_(torch.div(m, denom, out=a).mul_(lr / (1 - b1 ** t)))
        return None


def correct_sqrt(v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The correctly rounded square root of ``v`` (into ``out``, contiguous, if given; else a new
    tensor), the same bits on every device.

    torch's float sqrt is not correctly rounded on either side: CUDA's differs from the CPU's
    (bench/cuda_bits.py), and the CPU's AVX2 kernel is one ulp off for ~17 % of all float32
    values (every non-negative bit pattern checked on the 2-core VM, torch 2.13). A float64
    square root rounded once to float32 is the correctly rounded one (a double holds more than
    twice float's precision), so the device takes that path. On the host numpy's float32 sqrt
    is correctly rounded (the hardware's instruction; the same check: no bit pattern differs
    from the float64 path) and one pass instead of three: PortableAdamW's host update 2.7x faster
    on the 2-core VM (bench/host_rate.py, bench/RESULTS.md 2026-11-28). :func:`_numpy_sqrt_ok`
    checks it once per process."""
    if v.device.type == "cpu" and v.dtype == torch.float32 and _numpy_sqrt_ok():
        if out is None:
            out = torch.empty_like(v, memory_format=torch.contiguous_format)
        np.sqrt(v.numpy(), out=out.numpy())  # (numpy releases the GIL: host-update threads run at once)
        return out
    root = v.double().sqrt_()
    return root.to(v.dtype) if out is None else out.copy_(root)  # (rounded once to v's dtype either way)


@functools.lru_cache(maxsize=1)
def _numpy_sqrt_ok() -> bool:
    """Whether numpy's float32 sqrt gives the float64 path's bits on this machine: on the float32
    values torch's CPU kernel rounds wrongly (from [1, 4) and the extremes) and on random ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.arange(0x3F800000, 0x40800000, 97, dtype=torch.int64).to(torch.int32).view(torch.float32),
                   torch.rand(1 << 16, generator=g) * 1e-30, torch.rand(1 << 16, generator=g) * 1e30,
                   torch.tensor([0.0, -0.0, float("inf"), 1e-45, 3.4028235e38])])
    return torch.equal(torch.from_numpy(np.sqrt(x.numpy())).view(torch.int32), x.double().sqrt().float().view(torch.int32))


class OptimGroup:
    """One optimizer call for the parameters of many per-op optimizers.

    The per-parameter arithmetic is the same (SGD's ``foreach=False`` and AdamW's fused kernel
    update each parameter on its own), and the state lives where it did: the group's ``state``
    maps each parameter to its own op optimizer's state dict, which the update fills in place."""

    def __init__(self, config: OptimConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self._group: torch.optim.Optimizer | None = None

    def step(self, opts: Sequence[tuple[str, torch.optim.Optimizer]], lr: float) -> list[str]:
        """Step the parameters with gradients of every ``(op_id, optimizer)`` at ``lr``, then drop
        their gradients; returns the ops whose optimizer state was created by this step."""
        params, state, fresh = [], {}, []
        for op_id, opt in opts:
            with_grad = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p not in opt.state for p in with_grad):
                fresh.append(op_id)
            for p in with_grad:
                state[p] = opt.state[p]
            params += with_grad
        if not params:
            return fresh
        self._run(params, state, lr)
        for p in params:
            p.grad = None
        return fresh

    def step_apart(self, items: Sequence[tuple[torch.optim.Optimizer, nn.Parameter, torch.Tensor]], lr: float) -> None:
        """Step each ``(optimizer, parameter, gradient)`` at ``lr`` as :meth:`step` would with that
        gradient in ``.grad``, without touching the parameters' ``.grad`` (another thread may be
        using them): the optimizer sees an alias of each parameter (the same storage, so the update
        lands in it) over the parameter's own state dict, which it fills in place."""
        if not items:
            return
        params, state = [], {}
        for opt, p, g in items:
            alias = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            alias.grad = g
            state[alias] = opt.state[p]  # (a defaultdict: an empty dict on the first step, filled in place)
            params.append(alias)
        self._run(params, state, lr)

    def _run(self, params: list[nn.Parameter], state: dict, lr: float) -> None:
        """One optimizer call over ``params`` with their ``state`` dicts at ``lr``."""
        if self._group is None:
            self._group = self.config.build([nn.Parameter(torch.zeros(0, device=self.device))])
        group = self._group
        group.param_groups[0]["params"], group.param_groups[0]["lr"] = params, lr
        group.state = state
        try:
            eager.step(group)  # group.step(); in the app's processes without torch._dynamo (pipeline/eager.py)
        finally:
            group.param_groups[0]["params"], group.state = [], {}


def synthetic_update(config: OptimConfig, seed: int, numel: int) -> Callable[[], int]:
    """A host update of ``numel`` parameters (four tensors, random gradients) as a home update
    runs it: ``config``'s optimizer through an :class:`OptimGroup` of its own (``step_apart``).
    Returns a call that steps them once and says how many there are (what
    ``memory.host_update_rate: auto`` times, and ``bench/host_rate.py``)."""
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(numel // 4, generator=g)) for _ in range(4)]
    grads = [torch.randn(numel // 4, generator=g) for _ in range(4)]
    opt, group = config.build(params), OptimGroup(config, torch.device("cpu"))

    def step() -> int:
        group.step_apart([(opt, p, gr) for p, gr in zip(params, grads)], config.lr)
        return numel

    step.params = params  # (what it steps: a check of the bits reads them)
    return step
