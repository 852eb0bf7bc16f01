"""The op registry: candidate and fixed ops by name, with seeded construction and derived randomness.

An op is an ``nn.Module`` whose forward is ``forward(*inputs, ctx: OpContext) -> Tensor``.
Users add one with ``@register_op("name")`` on a builder (a class or function taking keyword
arguments). ``build_op`` constructs an op with its initial weights derived from
``(seed, op_id)`` alone, so any process can build any op and get the same weights, whatever
else it built before. Randomness inside a forward pass (dropout, ...) comes from
``ctx.generator()``, which is derived from ``(seed, step, microbatch, op_id)``: where an op
runs never changes what it computes.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import OpError

__all__ = ["OpSpec", "OpContext", "register_op", "registered_ops", "build_op", "derive_seed", "run_op", "op_contexts"]

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_op(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Register an op builder under ``name`` (decorator). Re-registering a name is an error."""

    def deco(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not builder:
            raise OpError(f"op {name!r} is already registered (by {_REGISTRY[name]!r}); pick another name")
        _REGISTRY[name] = builder
        return builder

    return deco


def registered_ops() -> tuple[str, ...]:
    _load_builtins()
    return tuple(sorted(_REGISTRY))


@dataclass(frozen=True)
class OpSpec:
    """What to build: a registered op name and its keyword arguments (kept sorted, hashable)."""

    kind: str
    args: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, **kwargs: Any) -> OpSpec:
        return cls(kind, tuple(sorted(kwargs.items())))

    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)

    def __str__(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={v!r}" for k, v in self.args) + ")"


def op_contexts(seed: int, step: int, microbatch: int, training: bool) -> Callable[[str], OpContext]:
    """The contexts of every op of one micro-batch: what :class:`~supernet.execute.SliceRun`
    takes (``op_id -> OpContext``)."""
    return lambda op_id: OpContext(seed, step, microbatch, op_id, training)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, stable across processes, machines and Python versions."""
    h = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class OpContext:
    """Where an op call sits in training: the source of all randomness inside a forward."""

    seed: int
    step: int
    microbatch: int
    op_id: str
    training: bool

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        if torch.device(device).type == "meta":  # shape inference: meta tensors take a CPU generator
            device = "cpu"
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed(self.seed, self.step, self.microbatch, self.op_id))
        return g


def build_op(spec: OpSpec, op_id: str, seed: int, seeded: bool = True) -> nn.Module:
    """Build the op ``spec`` with initial weights derived from ``(seed, op_id)`` only.

    ``seeded=False`` skips seeding, for a module whose values will be overwritten anyway (one
    built on the meta device to receive a migrating op's state)."""
    _load_builtins()
    try:
        builder = _REGISTRY[spec.kind]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise OpError(
            f"op {op_id!r}: unknown op kind {spec.kind!r}; registered ops are: {known}. "
            "Register a new one with @supernet.register_op(name)."
        ) from None
    try:
        if seeded:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, "init", op_id))
                module = builder(**spec.kwargs())
        else:
            module = builder(**spec.kwargs())
    except TypeError as e:
        raise OpError(f"op {op_id!r}: bad arguments for {spec}: {e}") from None
    if not isinstance(module, nn.Module):
        raise OpError(f"op {op_id!r}: builder for {spec.kind!r} returned {type(module).__name__}, expected nn.Module")
    return module


def run_op(module: nn.Module, inputs: list[torch.Tensor], ctx: OpContext) -> torch.Tensor:
    """Call one op. Outputs are made contiguous so that an op's result is laid out the same
    whether it is consumed in place or after crossing a process boundary."""
    if module.training != ctx.training:
        module.train(ctx.training)
    out = module(*inputs, ctx=ctx)
    if not isinstance(out, torch.Tensor):
        raise OpError(f"op {ctx.op_id!r} returned {type(out).__name__}; an op must return one Tensor")
    return out.contiguous()


def _load_builtins() -> None:
    # The built-in and built-in-space ops register themselves on import; importing lazily
    # keeps this module importable on its own and avoids an import cycle with supernet.spaces.
    from . import builtin_ops, spaces  # noqa: F401
