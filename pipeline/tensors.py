"""The tensor manager: the one place a process reaches the weights and optimizer state it owns.

Ops are the unit of ownership. A manager holds, for each op it owns, the op's module and a
per-op optimizer (``foreach=False``, so the update of an op is the same arithmetic whatever
else a process owns). ``export`` turns an op into a flat ``name -> tensor`` state
(``param/...``, ``buffer/...``, ``optim/<i>/<key>``) and gives it up; ``adopt`` takes one in.
Migration, checkpoints and the digest all use that flat form, so an op's weights and its
optimizer state always travel together. Everything is resident here; the virtualized tensor
manager will keep inactive ops elsewhere behind the same interface.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from supernet import OpSlot, SupernetGraph, build_op

__all__ = ["OptimConfig", "TensorManager", "OpState", "params_digest"]

OpState = dict[str, torch.Tensor]


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


class TensorManager:
    """The ops one process owns, their modules and their optimizers."""

    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig,
                 device: torch.device | str = "cpu", own: Iterable[str] = ()) -> None:
        self.graph = graph
        self.seed = seed
        self.optim = optim
        self.device = torch.device(device)
        self._slots: dict[str, OpSlot] = {s.op_id: s for s in graph.slots()}
        self._modules: dict[str, nn.Module] = {}
        self._optims: dict[str, torch.optim.Optimizer] = {}
        for op_id in own:
            self.create(op_id)

    # -- ownership -------------------------------------------------------------------------
    def owned(self) -> tuple[str, ...]:
        return tuple(self._modules)

    def owns(self, op_id: str) -> bool:
        return op_id in self._modules

    def module(self, op_id: str) -> nn.Module:
        try:
            return self._modules[op_id]
        except KeyError:
            raise KeyError(f"op {op_id!r} is not owned by this process (owned: {len(self._modules)} ops)") from None

    def create(self, op_id: str) -> None:
        """Build an op with its initial weights (derived from the seed and op id)."""
        self._install(op_id, build_op(self._slot(op_id).spec, op_id, self.seed).to(self.device))

    def adopt(self, op_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Take ownership of an op from its flat state (weights, buffers, optimizer state)."""
        spec = self._slot(op_id).spec
        with torch.device("meta"):
            module = build_op(spec, op_id, self.seed, seeded=False)
        module = module.to_empty(device=self.device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(state[f"param/{name}"])
            for name, b in module.named_buffers():
                b.copy_(state[f"buffer/{name}"])
        opt = self._install(op_id, module)
        params = list(module.parameters())
        for i, p in enumerate(params):
            entry = {key.split("/", 2)[2]: t.to(self.device) for key, t in state.items() if key.startswith(f"optim/{i}/")}
            if entry:
                opt.state[p] = entry

    def export(self, op_id: str, release: bool = True) -> OpState:
        """The op's flat state; with ``release`` the process gives the op up."""
        module, opt = self.module(op_id), self._optims[op_id]
        state: OpState = {}
        for name, p in module.named_parameters():
            state[f"param/{name}"] = p.detach()
        for name, b in module.named_buffers():
            state[f"buffer/{name}"] = b.detach()
        for i, p in enumerate(module.parameters()):
            for key, t in sorted(opt.state.get(p, {}).items()):
                if isinstance(t, torch.Tensor):
                    state[f"optim/{i}/{key}"] = t.detach()
        if release:
            del self._modules[op_id], self._optims[op_id]
        return state

    # -- training --------------------------------------------------------------------------
    def step(self, op_ids: Iterable[str], lr: float) -> None:
        """One optimizer step for each of ``op_ids`` (ops without gradients are left alone)."""
        for op_id in op_ids:
            opt = self._optims[op_id]
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        for opt in self._optims.values():
            opt.zero_grad(set_to_none=True)

    # -- internals -------------------------------------------------------------------------
    def _slot(self, op_id: str) -> OpSlot:
        try:
            return self._slots[op_id]
        except KeyError:
            raise KeyError(f"op {op_id!r} is not an op of supernet {self.graph.name!r}") from None

    def _install(self, op_id: str, module: nn.Module) -> torch.optim.Optimizer:
        if op_id in self._modules:
            raise RuntimeError(f"op {op_id!r} is already owned by this process; an op has exactly one owner")
        self._modules[op_id] = module
        opt = self.optim.build(list(module.parameters()) or [torch.nn.Parameter(torch.zeros(0, device=self.device))])
        self._optims[op_id] = opt
        return opt


def params_digest(states: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
    """sha256 over every parameter and buffer of every op, in canonical name order
    (``<op_id>.<name>`` sorted), covering name, dtype, shape and bytes."""
    h = hashlib.sha256()
    entries = []
    for op_id, state in states.items():
        for key, t in state.items():
            kind, _, name = key.partition("/")
            if kind in ("param", "buffer"):
                entries.append((f"{op_id}.{name}", t))
    for name, t in sorted(entries, key=lambda e: e[0]):
        t = t.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
