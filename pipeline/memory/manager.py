"""The tensor manager: the one place a process reaches the weights and optimizer state it owns.

Ops are the unit of ownership. A manager holds, for each op it owns, the op's module and a
per-op optimizer (:mod:`pipeline.memory.optim`). ``export`` turns an op into its flat state
(:mod:`pipeline.memory.state`) and gives it up; ``adopt`` takes one in.

Without a device budget (``MemorySettings.device_budget_bytes`` null, the default) every op is
resident on the device (:class:`~pipeline.memory.store.ResidentStore`). With one, the ops live
in host memory and a bounded device arena (:class:`~pipeline.memory.virtual.VirtualStore`): the
engine announces the coming steps' ops (``prefetch``), pins a step's ops before using them
(``ensure``; ``module`` pins on first use too) and unpins them after the optimizer step
(``release_step``). The manager drives both stores through the same calls; both compute the
same bits.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch import nn

from supernet import OpSlot, SupernetGraph, build_op

from .optim import OptimConfig, OptimGroup, synthetic_update
from .settings import MemorySettings
from .sizing import largest_subnet_footprint, op_footprints
from .state import OpState, optim_state_keys
from .stats import MemoryAudit, MemoryStats
from .store import Store, make_store

__all__ = ["TensorManager"]

RATE_PARAMS = 1 << 21  # memory.host_update_rate: auto: parameters each host-update thread steps to measure the rate


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
        self.device = torch.device(device)
        if self.device.type == "cuda" and optim.name == "adamw":  # host updates give the GPU's bits
            optim = dataclasses.replace(optim, portable=True)
        self.optim = optim
        self.memory = memory if memory is not None else MemorySettings()
        self._slots: dict[str, OpSlot] = {s.op_id: s for s in graph.slots()}
        self._modules: dict[str, nn.Module] = {}
        self._optims: dict[str, torch.optim.Optimizer] = {}
        self._state_keys = optim_state_keys(optim.name, optim.momentum)
        self._store: Store = make_store(self.memory, self.device, self._state_keys)
        self._group = OptimGroup(optim, self.device)
        self._home_groups = threading.local()  # per host-update thread, its optimizer group
        self._measured_rate: float | None = None  # memory.host_update_rate: auto, once measured
        for op_id in own:
            self.create(op_id)

    @property
    def virtual(self) -> bool:
        """Whether ops live in host memory behind a bounded device arena."""
        return self._store.virtual

    # -- ownership -------------------------------------------------------------------------
    def owned(self) -> tuple[str, ...]:
        return tuple(self._modules)

    def owns(self, op_id: str) -> bool:
        return op_id in self._modules

    def module(self, op_id: str) -> nn.Module:
        """The op's module, resident (with a budget: fetched if it is not, and pinned until
        ``release_step``)."""
        m = self.module_unpinned(op_id)
        self._store.use(op_id, mutates=True)
        return m

    def module_unpinned(self, op_id: str) -> nn.Module:
        """The op's module wherever it lives (no fetch, no pin): for inspection only."""
        try:
            return self._modules[op_id]
        except KeyError:
            raise KeyError(f"op {op_id!r} is not owned by this process (owned: {len(self._modules)} ops)") from None

    def create(self, op_id: str) -> None:
        """Build an op with its initial weights (derived from the seed and op id)."""
        module = build_op(self._slot(op_id).spec, op_id, self.seed).to(self._store.module_device)
        self._store.add(op_id, module, self._install(op_id, module))

    def adopt(self, op_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Take ownership of an op from its flat state (weights, buffers, optimizer state).
        With a budget the op lands in host memory (it is fetched when needed)."""
        with torch.device("meta"):
            module = build_op(self._slot(op_id).spec, op_id, self.seed, seeded=False)
        module = module.to_empty(device=self._store.module_device)
        opt = self._install(op_id, module)
        try:
            self._store.add(op_id, module, opt, dict(state))
        except BaseException:
            del self._modules[op_id], self._optims[op_id]
            raise

    def export(self, op_id: str, release: bool = True) -> OpState:
        """The op's flat state; with ``release`` the process gives the op up. All resident: the
        op's tensors themselves. With a budget the tensors are host tensors (never staged
        through the device): a copy of the op's host home, or with ``release`` the home itself
        (views of one buffer per op: send them, or clone them before ``torch.save``)."""
        self.module_unpinned(op_id)
        state = self._store.export(op_id, copy=not release)
        if release:
            self._store.remove(op_id)
            del self._modules[op_id], self._optims[op_id]
        return state

    # -- residency -------------------------------------------------------------------------
    def prefetch(self, upcoming: Sequence[Collection[str]],
                 host_seconds: Sequence[float | None] | None = None) -> None:
        """The op ids of the coming steps, in order (the first: the step about to run, whose
        ``ensure`` comes next); fetching starts in the background. Unowned ids are ignored.
        ``host_seconds``: per coming step, the seconds it computes here (its estimate): with the
        hybrid placement and ``memory.host_update_rate``, the host steps no more of a step's ops
        than it can in that time (None: no limit)."""
        budget = None
        if host_seconds is not None and any(s is not None for s in host_seconds):
            rate = self.host_update_rate()
            if rate is not None:
                budget = [None if s is None else rate * s for s in host_seconds]
        self._store.prefetch(upcoming, budget)

    def host_update_rate(self) -> float | None:
        """The parameters a second the host steps (``memory.host_update_rate``; ``auto``: measured
        once, on the host-update threads with this run's optimizer); None without a limit or
        where the host steps nothing of its own accord (no budget, or not ``hybrid``)."""
        rate = self.memory.host_update_rate
        if rate != "auto":
            return rate
        if not self.virtual or self.memory.optimizer != "hybrid":
            return None
        if self._measured_rate is None:
            self._measured_rate = self._store.host_updates.throughput(self._rate_job)
        return self._measured_rate

    @property
    def measured_host_rate(self) -> float | None:
        """What ``memory.host_update_rate: auto`` measured (None: not measured)."""
        return self._measured_rate

    def _rate_job(self, k: int) -> Callable[[], int]:
        """One host-update thread's part of the measurement: :data:`RATE_PARAMS` parameters stepped
        as a home update steps them (this run's optimizer: PortableAdamW where the device is CUDA)."""
        return synthetic_update(self.optim, k, RATE_PARAMS)

    def ensure(self, op_ids: Collection[str]) -> None:
        """Make ``op_ids`` resident and pin them until ``release_step`` (a stall when they were
        not fetched ahead)."""
        self._store.ensure(op_ids)

    def release_step(self, advance: bool = True, ops: Collection[str] | None = None, done: int = 0,
                     in_flight: int = 0) -> MemoryStats:
        """End of a step: unpin its ops, move the announced future on (``advance``), keep
        prefetching. Returns the step's counters (all-resident: its uses as hits). With several
        subnets in flight, one subnet's end: unpin ``ops`` alone (those no other subnet in flight
        uses) and drop the future's entry ``done`` (the subnet's place in the announced order);
        ``in_flight``: the subnets still in flight here, the future's first entries (the fetches
        ahead look ``prefetch_depth + 1`` entries past them)."""
        return self._store.release_step(advance, ops, done, in_flight)

    def stats(self) -> MemoryStats:
        """Totals so far (all-resident: the bytes of every owned op)."""
        return self._store.stats()

    def resident_bytes(self) -> int:
        """Bytes of weights, buffers and optimizer state on the device now, counted from the
        tensors themselves (all-resident mode) or the arena's regions (with a budget)."""
        return self._store.resident_bytes()

    def audit(self) -> MemoryAudit | None:
        """An independent count of the device tier, from the tensors (``None``: no budget)."""
        return self._store.audit()

    def footprint(self, op_ids: Iterable[str]) -> int:
        """Bytes ``op_ids`` take in the arena together (see :meth:`footprints`)."""
        return sum(self.footprints(op_ids).values())

    def largest_subnet_footprint(self) -> int:
        """Bytes the largest subnet takes in the arena (:func:`~pipeline.memory.sizing.largest_subnet_footprint`)."""
        return largest_subnet_footprint(self.graph, self.footprints(self._slots))

    def footprints(self, op_ids: Iterable[str]) -> dict[str, int]:
        """Per op, the bytes it takes in the arena under this manager's settings, owned or not
        (:func:`~pipeline.memory.sizing.footprints`)."""
        return op_footprints(self.graph, self.seed, self.optim, self.device, self.memory, op_ids)

    def close(self) -> None:
        """Wait for copies in flight and stop the copy thread."""
        self._store.close()

    # -- training --------------------------------------------------------------------------
    def step(self, op_ids: Iterable[str], lr: float) -> None:
        """One optimizer step for each of ``op_ids`` (ops without gradients are left alone), all
        in one optimizer call. An op updated on the host (``memory.optimizer=host``, or
        ``hybrid`` when its state stayed home) has its gradients sent home first and leaves the
        device; its update runs on its host home."""
        op_ids = list(dict.fromkeys(op_ids))
        stepped = self._store.prepare_step(op_ids)
        home = self._store.updating_home()
        fresh = self._group.step([(o, self._optims[o]) for o in op_ids if o not in home], lr)
        self._store.finish_step(stepped, fresh, functools.partial(self._step_at_home, lr=lr) if home else None)

    def _step_at_home(self, op_id: str, grads: Sequence[torch.Tensor | None], lr: float) -> None:
        """One op's optimizer step in its host home with ``grads`` (per parameter; on a
        host-update thread: each thread its own optimizer group, built as the device's is, so the
        arithmetic is the same; the parameters' ``.grad`` stay the training thread's)."""
        group = getattr(self._home_groups, "group", None)
        if group is None:
            group = self._home_groups.group = OptimGroup(self.optim, self._group.device)
        opt = self._optims[op_id]
        params = [p for g in opt.param_groups for p in g["params"]]
        group.step_apart([(opt, p, g) for p, g in zip(params, grads) if g is not None], lr)

    def zero_grad(self, op_ids: Iterable[str] | None = None) -> None:
        """Drop the gradients of ``op_ids`` (default: of every op this process owns)."""
        for opt in (self._optims.values() if op_ids is None else (self._optims[op] for op in op_ids)):
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
        dummy = torch.nn.Parameter(torch.zeros(0, device=self._store.module_device))  # an op without parameters
        opt = self.optim.build(list(module.parameters()) or [dummy])
        self._optims[op_id] = opt
        return opt
