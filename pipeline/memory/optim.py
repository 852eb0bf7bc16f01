"""Per-op optimizers: their settings, and one optimizer call that steps many ops at once.

Every op has its own optimizer (``foreach=False``, so an op's update is the same arithmetic
whatever else a process owns, and its state travels with it). A step of tens of ops through
tens of optimizer calls costs ~40 us of hooks and bookkeeping each, so :class:`OptimGroup`
steps them in one call over the same per-parameter state dicts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OptimConfig", "OptimGroup"]


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

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"train.optimizer.name: expected 'sgd' or 'adamw', found {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"train.optimizer.lr: expected a positive number, found {self.lr}")

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                                   nesterov=self.nesterov, foreach=False)
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=False)


class OptimGroup:
    """One optimizer call for the parameters of many per-op optimizers.

    The per-parameter arithmetic is the same (``foreach=False`` updates each parameter on its
    own), and the state lives where it did: the group's ``state`` maps each parameter to its
    own op optimizer's state dict, which the update fills in place."""

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
        if self._group is None:
            self._group = self.config.build([nn.Parameter(torch.zeros(0, device=self.device))])
        group = self._group
        group.param_groups[0]["params"], group.param_groups[0]["lr"] = params, lr
        group.state = state
        try:
            group.step()
        finally:
            group.param_groups[0]["params"], group.state = [], {}
        for p in params:
            p.grad = None
        return fresh
