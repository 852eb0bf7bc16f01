"""The tensor manager: the one place a process reaches the weights and optimizer state it owns.

Ops are the unit of ownership. A manager holds, for each op it owns, the op's module and a
per-op optimizer (``foreach=False``, so the update of an op is the same arithmetic whatever
else a process owns). ``export`` turns an op into a flat ``name -> tensor`` state
(``param/...``, ``buffer/...``, ``optim/<i>/<key>``) and gives it up; ``adopt`` takes one in.
Migration, checkpoints and the digest all use that flat form, so an op's weights and its
optimizer state always travel together.

Without a device budget (``MemorySettings.device_budget_bytes`` null, the default) every op is
resident on the device. With one, the ops live in host memory and a bounded device arena
(:mod:`pipeline.memory`): the engine announces the coming steps' ops (``prefetch``), pins a
step's ops before using them (``ensure``; ``module`` pins on first use too) and unpins them
after the optimizer step (``release_step``). Both modes compute the same bits.
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from supernet import OpSlot, SupernetGraph, build_op

from .memory import MemoryAudit, MemoryStats, device_bytes, op_layout, optim_state_keys
from .memory_store import VirtualStore
from .memory_arena import alignment_for
from .memory_settings import MemorySettings

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
    """The ops one process owns, their modules and their optimizers.

    ``memory`` (default: no budget) decides where they live: all resident on ``device``, or
    in host memory with a device arena of ``memory.device_budget_bytes``. An engine drives a
    step the same way in both modes (each call is cheap or a no-op without a budget)::

        tensors.prefetch([ops_now, ops_next, ...])  # this process's ops per step, this one first
        tensors.ensure(ops_now)                     # after migration settled, before compute
        ... SliceRun(sl, tensors.module, ...) ...   # module() pins on first use too
        tensors.step(ops_now, lr)
        stats = tensors.release_step()              # unpin, move the future on, keep prefetching

    and an evaluation as ``ensure(ops)`` ... ``release_step(advance=False)``. ``export`` and
    ``adopt`` work whether an op is resident or not, from the main thread, at any time an op
    is not in use; all calls are serialised by one lock."""

    def __init__(self, graph: SupernetGraph, seed: int, optim: OptimConfig,
                 device: torch.device | str = "cpu", own: Iterable[str] = (),
                 memory: MemorySettings | None = None) -> None:
        self.graph = graph
        self.seed = seed
        self.optim = optim
        self.device = torch.device(device)
        self.memory = memory if memory is not None else MemorySettings()
        self._slots: dict[str, OpSlot] = {s.op_id: s for s in graph.slots()}
        self._modules: dict[str, nn.Module] = {}
        self._optims: dict[str, torch.optim.Optimizer] = {}
        self._state_keys = optim_state_keys(optim.name, optim.momentum)
        self._store = VirtualStore(self.memory, self.device, self._state_keys) if self.memory.virtual else None
        self._plain = MemoryStats()  # all-resident mode: uses counted as hits
        self._bytes: dict[str, int] = {}  # all-resident mode: each op's bytes on the device
        self._group: torch.optim.Optimizer | None = None  # all-resident mode: steps many ops at once
        for op_id in own:
            self.create(op_id)

    @property
    def virtual(self) -> bool:
        """Whether ops live in host memory behind a bounded device arena."""
        return self._store is not None

    # -- ownership -------------------------------------------------------------------------
    def owned(self) -> tuple[str, ...]:
        return tuple(self._modules)

    def owns(self, op_id: str) -> bool:
        return op_id in self._modules

    def module(self, op_id: str) -> nn.Module:
        """The op's module, resident (with a budget: fetched if it is not, and pinned until
        ``release_step``)."""
        try:
            m = self._modules[op_id]
        except KeyError:
            raise KeyError(f"op {op_id!r} is not owned by this process (owned: {len(self._modules)} ops)") from None
        if self._store is not None:
            self._store.use(op_id, mutates=True)
        return m

    def create(self, op_id: str) -> None:
        """Build an op with its initial weights (derived from the seed and op id)."""
        module = build_op(self._slot(op_id).spec, op_id, self.seed)
        if self._store is None:
            self._install(op_id, module.to(self.device))
            return
        opt = self._install(op_id, module)
        self._store.add(op_id, module, opt)

    def adopt(self, op_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Take ownership of an op from its flat state (weights, buffers, optimizer state).
        With a budget the op lands in host memory (it is fetched when needed)."""
        spec = self._slot(op_id).spec
        with torch.device("meta"):
            module = build_op(spec, op_id, self.seed, seeded=False)
        if self._store is not None:
            module = module.to_empty(device="cpu")
            opt = self._install(op_id, module)
            try:
                self._store.add(op_id, module, opt, dict(state))
            except BaseException:
                del self._modules[op_id], self._optims[op_id]
                raise
            return
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
        """The op's flat state; with ``release`` the process gives the op up. With a budget the
        tensors are host tensors (never staged through the device): a copy of the op's host home,
        or with ``release`` the home itself (views of one buffer per op: send them, or clone
        them before ``torch.save``)."""
        module, opt = self.module_unpinned(op_id), self._optims[op_id]
        if self._store is not None:
            state = self._store.export(op_id, copy=not release)
            if release:
                self._store.remove(op_id)
                del self._modules[op_id], self._optims[op_id]
            return state
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
            self._bytes.pop(op_id, None)
        return state

    def module_unpinned(self, op_id: str) -> nn.Module:
        """The op's module wherever it lives (no fetch, no pin): for inspection only."""
        try:
            return self._modules[op_id]
        except KeyError:
            raise KeyError(f"op {op_id!r} is not owned by this process (owned: {len(self._modules)} ops)") from None

    # -- residency -------------------------------------------------------------------------
    def prefetch(self, upcoming: Sequence[Collection[str]]) -> None:
        """The op ids of the coming steps, in order (the first: the step about to run, whose
        ``ensure`` comes next); fetching starts in the background. Unowned ids are ignored."""
        if self._store is not None:
            self._store.prefetch(upcoming)

    def ensure(self, op_ids: Collection[str]) -> None:
        """Make ``op_ids`` resident and pin them until ``release_step`` (a stall when they were
        not fetched ahead)."""
        if self._store is not None:
            self._store.ensure(op_ids)
        else:
            n = sum(1 for o in dict.fromkeys(op_ids) if o in self._modules)
            self._plain = MemoryStats(hits=self._plain.hits + n)

    def release_step(self, advance: bool = True) -> MemoryStats:
        """End of a step: unpin its ops, move the announced future on (``advance``), keep
        prefetching. Returns the step's counters (all-resident: its uses as hits)."""
        if self._store is not None:
            return self._store.release_step(advance)
        step, self._plain = self._plain, MemoryStats()
        nbytes = self.resident_bytes()
        return MemoryStats(None, nbytes, nbytes, hits=step.hits)

    def stats(self) -> MemoryStats:
        """Totals so far (all-resident: the bytes of every owned op)."""
        if self._store is not None:
            return self._store.stats()
        nbytes = self.resident_bytes()
        return MemoryStats(None, nbytes, nbytes)

    def resident_bytes(self) -> int:
        """Bytes of weights, buffers and optimizer state on the device now, counted from the
        tensors themselves (all-resident mode) or the arena's regions (with a budget)."""
        if self._store is not None:
            return self._store.arena.used
        return sum(self._bytes.get(o) if o in self._bytes else self._count(o) for o in self._modules)

    def _count(self, op_id: str) -> int:
        m, total = self._modules[op_id], 0
        total += sum(t.nbytes for t in m.parameters()) + sum(t.nbytes for t in m.buffers())
        for st in self._optims[op_id].state.values():
            total += sum(t.nbytes for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        self._bytes[op_id] = total
        return total

    def audit(self) -> MemoryAudit | None:
        """An independent count of the device tier, from the tensors (``None``: no budget)."""
        return self._store.audit() if self._store is not None else None

    def footprint(self, op_ids: Iterable[str]) -> int:
        """Bytes ``op_ids`` take in the arena together (see :meth:`footprints`)."""
        return sum(self.footprints(op_ids).values())

    def largest_subnet_footprint(self) -> int:
        """Bytes the largest subnet takes in the arena: every slot's biggest candidate, and the
        fixed ops (the least budget with which any subnet of the supernet can run in one process)."""
        sizes = self.footprints(slot.op_id for slot in self.graph.slots())
        by_node: dict[str, int] = {}
        for slot in self.graph.slots():
            by_node[slot.node] = max(by_node.get(slot.node, 0), sizes[slot.op_id])
        return sum(by_node.values())

    def footprints(self, op_ids: Iterable[str]) -> dict[str, int]:
        """Per op, the bytes it takes in the arena (aligned weights, buffers and, unless it is
        updated on the host, optimizer state), computed from its spec without building real
        weights; owned or not."""
        align = alignment_for(self.device)
        out = {}
        for op_id in op_ids:
            with torch.device("meta"):
                module = build_op(self._slot(op_id).spec, op_id, self.seed, seeded=False)
            out[op_id] = device_bytes(op_layout(module, self._state_keys, align), self.memory.optimizer == "host")
        return out

    def close(self) -> None:
        """Wait for copies in flight and stop the copy thread."""
        if self._store is not None:
            self._store.close()

    # -- training --------------------------------------------------------------------------
    def step(self, op_ids: Iterable[str], lr: float) -> None:
        """One optimizer step for each of ``op_ids`` (ops without gradients are left alone), all
        in one optimizer call. With the optimizer on the host (``memory.optimizer=host``) each
        op's gradients go to its host home first and the op leaves the device; the update then
        runs on the host homes."""
        if self._store is None:
            self._step_together(op_ids, lr)
            return
        op_ids = list(dict.fromkeys(op_ids))
        host_update = self._store.host_update
        stepped = []
        for op_id in op_ids:
            self._store.use(op_id, mutates=False)
            params = [p for g in self._optims[op_id].param_groups for p in g["params"]]
            if host_update:  # gradients to the host, the op leaves the device, the host updates it
                grads = self._store.to_host(op_id)
                if len(grads) == len(params):  # (an op without parameters has one placeholder)
                    for p, g in zip(params, grads):
                        p.grad = g
            if host_update or any(p.grad is not None for p in params):
                stepped.append(op_id)
        self._step_together(op_ids, lr)
        for op_id in stepped:
            if host_update:
                self._store.host_stepped(op_id)
            else:
                self._store.stepped(op_id)

    def _step_together(self, op_ids: Iterable[str], lr: float) -> None:
        """The ops' parameters (those with gradients) stepped by one optimizer call instead of one call
        per op (each call costs ~40 us of hooks and bookkeeping; a subnet has tens of ops).
        The per-parameter arithmetic is the same (``foreach=False`` updates each parameter on
        its own), and the state lives where it did: ``state`` maps each parameter to its own
        op optimizer's state dict, which the update fills in place."""
        params, state, fresh = [], {}, []
        for op_id in op_ids:
            opt = self._optims[op_id]
            with_grad = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p not in opt.state for p in with_grad):
                fresh.append(op_id)  # state created now: the op takes more bytes afterwards
            for p in with_grad:
                state[p] = opt.state[p]
            params += with_grad
        if not params:
            return
        if self._group is None:
            self._group = self.optim.build([torch.nn.Parameter(torch.zeros(0, device=self.device))])
        group = self._group
        group.param_groups[0]["params"], group.param_groups[0]["lr"] = params, lr
        group.state = state
        try:
            group.step()
        finally:
            group.param_groups[0]["params"], group.state = [], {}
        for p in params:
            p.grad = None
        for op_id in fresh:
            self._bytes.pop(op_id, None)

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
        dummy_device = self.device if self._store is None else "cpu"
        opt = self.optim.build(list(module.parameters()) or [torch.nn.Parameter(torch.zeros(0, device=dummy_device))])
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
