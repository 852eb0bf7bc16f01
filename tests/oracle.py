"""An oracle for the shared-op modes: plain PyTorch training of a supernet's subnets, written
apart from the engines, which must reproduce it bit for bit (tests/test_delayed_oracle.py).

It takes from the project only the ops (``supernet.build_op``: the same modules and initial
weights) and each subnet's active ops; nothing from ``pipeline``. What a step reads of a
*shared* op (one with state that every subnet runs: stem, head, ...) and what its update
changes is written here from the semantics the README states for ``pipeline.shared_ops``:

* ``delayed`` with delay D: step t runs the version of each shared op that the update of step
  ``max(t - D, floor(t)) - 1`` produced, where ``floor(t)`` is the last checkpoint boundary at
  or before t (the version "after step floor - 1" is the state at the boundary). Its gradients,
  summed over the micro-batches in order, are applied to the *current* weights by the
  optimizer, one update per subnet in subnet order; the batch-norm statistics it updated
  replace the op's (``pipeline/shared.py`` documents this choice for buffers).
* ``exact`` is the same with D = 0: every step reads the previous step's update, i.e.
  sequential training.
* ``frozen``: every step runs the initial weights and buffers (no gradients) and nothing is
  written back.

``compensation`` (delayed only; ``pipeline.delay_compensation``, coefficient c), as the README
states it: ``predict``: step t runs, for each parameter of a shared op, ``v_r + c*d*(v_r - v_{r-1})``
where ``r`` is the step it reads, ``d = t - 1 - r`` the updates it misses and ``v_r`` the value
after step r, when ``d > 0`` and ``r - 1`` is not before ``floor(t) - 1`` (else ``v_r``; buffers are
never moved); ``dc``: a shared op's gradient reaches the live weights as
``g + c*g*g*(live - read)``; ``step``: after the optimizer step, each shared op's parameter is
``before + c*(after - before)``.

Every version is kept (a dict by step, no ring), so a version the engine drops too early, a
boundary it puts elsewhere or a gradient it applies to the wrong weights would show.

Limits: the forward is plain autograd, so the subnet must be a chain (no node read twice: the
engine sums a fanned-out tensor's gradients in an order of its own). The built-in conv and
transformer spaces are chains; the cell space is not.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from supernet import INPUT, Arch, OpContext, SupernetGraph, build_op

__all__ = ["OracleRun", "cosine_lr", "shared_ops", "train"]

StepItem = tuple[int, Arch, torch.Tensor, torch.Tensor]  # (step, arch, x, y)


def cosine_lr(base: float, total_steps: int, warmup_steps: int = 0, kind: str = "cosine",
              min_lr: float = 0.0) -> Callable[[int], float]:
    """The learning rate of a step: linear warm-up, then constant or cosine decay to ``min_lr``
    (the README's ``train.lr_schedule``; the same float operations in the same order)."""

    def lr(step: int) -> float:
        if step < warmup_steps:
            return base * (step + 1) / warmup_steps
        if kind == "constant":
            return base
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * min(1.0, t)))

    return lr


def shared_ops(graph: SupernetGraph, seed: int = 0) -> frozenset[str]:
    """The ops every subnet runs (the graph's fixed ops) that have parameters or buffers."""
    out = set()
    for slot in graph.slots():
        if slot.op_id == slot.node:
            m = build_op(slot.spec, slot.op_id, seed)
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                out.add(slot.op_id)
    return frozenset(out)


@dataclass
class OracleRun:
    """What the oracle computed: per step, the micro-batch losses and the step whose version of
    the shared ops it read (-1: the initial weights); at the end, every op's flat state
    (``param/<name>``, ``buffer/<name>``, ``optim/<i>/<key>``: the engines' ``op_states`` form)."""

    losses: list[tuple[float, ...]] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def step_losses(self) -> list[float]:
        return [float(sum(mb)) for mb in self.losses]


def _optimizer(optim, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """One plain torch optimizer over every parameter: SGD with ``foreach=False`` and AdamW's
    fused CPU kernel (the engine's choice) both update each parameter on its own, element by
    element, so one optimizer does what one per op does."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay,
                               nesterov=optim.nesterov, foreach=False)
    if optim.name == "adamw":
        return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                 weight_decay=optim.weight_decay, fused=True)
    raise ValueError(f"oracle: unknown optimizer {optim.name!r}")


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _contiguous(g: torch.Tensor) -> torch.Tensor:
    # the engine hands a gradient on contiguous, as if it had crossed a stage boundary
    return g.contiguous()


def train(graph: SupernetGraph, seed: int, items: Sequence[StepItem], *, optim, lr: Callable[[int], float],
          microbatches: int, mode: str = "exact", delay: int = 0, checkpoint_every: int = 0,
          compensation: str = "none", coef: float = 1.0, delays: Mapping[str, int] | None = None) -> OracleRun:
    """Train ``items`` (step, arch, x, y; steps 0, 1, 2, ... in order) from the initial weights.
    ``optim``: the optimizer's settings (``name``, ``lr``, ``momentum``, ``weight_decay``,
    ``betas``, ``eps``, ``nesterov``); ``mode``: ``exact``, ``delayed`` (``delay`` >= 1) or
    ``frozen``; ``compensation``: ``none``, ``predict``, ``dc`` or ``step`` (delayed only);
    ``delays`` (delayed only): a shared op's own delay instead of ``delay`` (0: read exactly,
    no compensation)."""
    if mode not in ("exact", "delayed", "frozen"):
        raise ValueError(f"oracle: mode {mode!r}")
    if compensation not in ("none", "predict", "dc", "step"):
        raise ValueError(f"oracle: compensation {compensation!r}")
    if mode != "delayed":
        compensation = "none"
    coef = float(coef)
    if mode == "exact":
        delay = 0
    own = dict(delays or {}) if mode == "delayed" else {}
    modules = {s.op_id: build_op(s.spec, s.op_id, seed) for s in graph.slots()}
    shared = shared_ops(graph, seed)
    opt = _optimizer(optim, [p for m in modules.values() for p in m.parameters()])
    # after[k][op]: the state of shared op ``op`` after the update of step k (-1: initial)
    after: dict[int, dict[str, dict[str, torch.Tensor]]] = {-1: {op: _state(modules[op]) for op in shared}}
    run = OracleRun()
    for expected, (step, arch, x, y) in enumerate(items):
        if step != expected:
            raise ValueError(f"oracle: expected step {expected}, found {step} (steps run from 0 in order)")
        active = graph.active_ops(arch)
        readers = [src for op in active for src in op.inputs]
        if len(readers) != len(set(readers)):
            raise ValueError(f"oracle: subnet {dict(arch)} reads a node twice; the oracle runs chains only")

        # which version of each shared op this step runs
        floor = (step // checkpoint_every) * checkpoint_every if checkpoint_every else 0
        def reads(d: int) -> int:  # the version a shared op with delay ``d`` is read at
            return -1 if mode == "frozen" else max(step - d, floor) - 1

        run.reads.append(reads(delay))
        runs: dict[str, nn.Module] = {}
        for op in active:
            live = modules[op.op_id]
            if op.op_id not in shared:
                runs[op.op_id] = live
                continue
            read = reads(own.get(op.op_id, delay))
            missed = step - 1 - read
            predict = compensation == "predict" and missed > 0 and read - 1 >= floor - 1
            view = copy.deepcopy(live)
            view.load_state_dict(after[read][op.op_id])
            if predict:  # the version read, moved on along its last update by the updates it misses
                now, before = after[read][op.op_id], after[read - 1][op.op_id]
                with torch.no_grad():
                    for name, p in view.named_parameters():
                        p.copy_(now[name] + (coef * missed) * (now[name] - before[name]))
            for p in view.parameters():
                p.grad = None
                p.requires_grad_(mode != "frozen")
            runs[op.op_id] = view

        # forward and backward of each micro-batch; gradients add up in micro-batch order
        if x.shape[0] % microbatches:
            raise ValueError(f"oracle: {microbatches} micro-batches do not divide a batch of {x.shape[0]}")
        size = x.shape[0] // microbatches
        losses = []
        for mb in range(microbatches):
            xm, ym = x[mb * size:(mb + 1) * size], y[mb * size:(mb + 1) * size]
            env = {INPUT: xm}
            for op in active:
                args = [env[src] for src in op.inputs]
                for a in args:
                    if a.requires_grad:
                        a.register_hook(_contiguous)
                ctx = OpContext(seed, step, mb, op.op_id, True)
                env[op.node] = runs[op.op_id](*args, ctx=ctx).contiguous()
            # cross-entropy summed over the micro-batch over the whole batch's size: the
            # micro-batch losses add up to the batch mean
            loss = F.cross_entropy(env[graph.output], ym, reduction="sum") / x.shape[0]
            loss.backward()
            losses.append(loss.item())
        run.losses.append(tuple(losses))

        # a shared op's gradients go to the live weights, its new statistics replace the live ones
        if mode != "frozen":
            for op in active:
                live, view = modules[op.op_id], runs[op.op_id]
                if view is live:
                    continue
                grads = dict(view.named_parameters())
                for name, p in live.named_parameters():
                    g = grads[name].grad
                    # DC-ASGD, from the weights it read (an op read exactly has none to correct)
                    if compensation == "dc" and g is not None and own.get(op.op_id, delay) > 0:
                        g = g.detach() + coef * (g * g * (p.detach() - grads[name].detach()))
                    p.grad = g
                stats = dict(view.named_buffers())
                with torch.no_grad():
                    for name, b in live.named_buffers():
                        b.copy_(stats[name])
        if all(math.isfinite(v) for v in losses):
            for group in opt.param_groups:
                group["lr"] = lr(step)
            stepped = {op: {n: p.detach().clone() for n, p in modules[op].named_parameters()}
                       for op in shared if own.get(op, delay) > 0} if compensation == "step" else {}
            opt.step()
            with torch.no_grad():
                for op, before in stepped.items():  # the shared ops' step, scaled by c
                    for name, p in modules[op].named_parameters():
                        p.copy_(before[name] + coef * (p - before[name]))
        opt.zero_grad(set_to_none=True)
        after[step] = {op: _state(modules[op]) for op in shared}

    for op_id, m in modules.items():
        flat = {f"param/{n}": p.detach().clone() for n, p in m.named_parameters()}
        flat.update({f"buffer/{n}": b.detach().clone() for n, b in m.named_buffers()})
        for i, p in enumerate(m.parameters()):
            for key, t in sorted(opt.state.get(p, {}).items()):
                if isinstance(t, torch.Tensor):
                    flat[f"optim/{i}/{key}"] = t.detach().clone()
        run.states[op_id] = flat
    return run
