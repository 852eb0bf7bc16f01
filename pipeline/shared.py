"""Shared ops (in every subnet: stem, head, embeddings, norms): exact, delayed or frozen.

An op that every subnet runs conflicts with every subnet, so keeping several subnets in flight
needs a choice for it, made once per run (``pipeline.shared_ops``) and run the same way by the
single-process reference and the pipeline, so both compute the same bits:

* ``exact``: read after the previous subnet's update, as sequential training does.
* ``delayed`` (``pipeline.shared_delay`` = D): subnet ``t`` runs a private copy of the op's
  parameters and buffers as they were after the update of subnet ``r - 1``, where
  ``r = max(t - D, floor)`` and ``floor`` is the step of the last checkpoint boundary (so a run
  resumed from a checkpoint reads what the uninterrupted one read). Its gradients are applied
  to the current weights by the optimizer, in subnet order (one update per subnet, as in
  PipeDream-2BW's fixed delay); the buffers it updated (batch-norm statistics) replace the
  op's at that update. A ring of the last D + 1 versions is kept.
  What it does about the staleness (``pipeline.delay_compensation``, with coefficient c):
  ``predict`` (SpecTrain / PipeMare weight prediction, from the kept versions rather than the
  optimizer's state, so any optimizer): the private copy's parameters are
  ``v_k + c * d * (v_k - v_{k-1})``, the version read moved on along its last update by the
  ``d = t - 1 - k`` updates it misses (none where ``v_{k-1}`` is from before the boundary, or
  the start); ``dc`` (DC-ASGD): the gradient reaching the live op is
  ``g + c * g * g * (w_live - w_read)``; ``step``: a delayed op's update is scaled by c. Buffers
  are never extrapolated. The ring then keeps D + 2 versions.
  ``pipeline.shared_delays`` gives an op its own D instead (0: read exactly, as ``exact``
  does): a shorter delay trains closer to sequential training, but a later subnet may then
  overtake fewer earlier ones where that op sits (the schedule's wait rule reads the same delays).
* ``frozen`` (NASPipe's choice): never updated. Each subnet runs a private copy whose
  parameters get no gradient and whose buffer updates are dropped, so no two subnets in flight
  touch the op's state and the order they run in cannot matter.

Pure bookkeeping over modules handed in; no messages. One instance per process, holding the
versions of the shared ops this process owns.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from supernet import SupernetGraph, build_op

from .settings import SHARED_MODES, check_compensation, check_delays

__all__ = ["SharedOps", "SHARED_MODES", "read_late", "shared_ops_of", "stateful_ops"]

VERSION = "version/"  # the prefix of a delayed op's kept versions in its moving state


@lru_cache(maxsize=64)
def stateful_ops(graph: SupernetGraph) -> frozenset[str]:
    """The ops with parameters or buffers (decided on the meta device, without real weights):
    the only ones whose order between subnets matters. Once per graph (the lookahead planner
    and the shared ops both ask) and one build per distinct spec (NASPipe's space: ~25 for
    ~1150 ops)."""
    has_state: dict = {}  # spec -> whether its module has parameters or buffers
    with torch.device("meta"):
        for slot in graph.slots():
            if slot.spec not in has_state:
                m = build_op(slot.spec, slot.op_id, 0, seeded=False)
                has_state[slot.spec] = any(True for _ in m.parameters()) or any(True for _ in m.buffers())
    return frozenset(slot.op_id for slot in graph.slots() if has_state[slot.spec])


def shared_ops_of(graph: SupernetGraph) -> frozenset[str]:
    """The ops every subnet runs that have state: the graph's fixed ops with parameters or buffers."""
    return frozenset(s.op_id for s in graph.slots() if s.op_id == s.node) & stateful_ops(graph)


def read_late(mode: str, shared: frozenset[str], delay: int,
              delays: Mapping[str, int]) -> tuple[frozenset[str], dict[str, int]]:
    """The ops read late (every shared op in delayed mode but those given delay 0) and those
    of them whose own delay is not ``delay`` (``pipeline.shared_delays``): what a schedule's wait
    rule needs (:class:`~pipeline.plan.schedule.Schedule`'s ``delayed`` and ``delays``)."""
    if mode != "delayed":
        return frozenset(), {}
    late = frozenset(op for op in shared if delays.get(op, delay) > 0)
    return late, {op: d for op, d in sorted(delays.items()) if op in late and d != delay}


class SharedOps:
    """Which module a subnet runs for each shared op, and what its update does (module doc)."""

    def __init__(self, mode: str, delay: int, shared: Iterable[str], checkpoint_every: int,
                 module: Callable[[str], nn.Module], compensation: str = "none", coef: float = 1.0,
                 delays: Mapping[str, int] | None = None) -> None:
        if mode not in SHARED_MODES:
            raise ValueError(f"pipeline.shared_ops: expected one of {list(SHARED_MODES)}, found {mode!r}")
        self.mode, self.delay, self.every = mode, delay, checkpoint_every
        self.shared = frozenset(shared)
        delays = check_delays(delays or {})
        unknown = sorted(set(delays) - self.shared)
        if unknown:
            raise ValueError(f"pipeline.shared_delays: expected shared ops of this space ({sorted(self.shared)}), "
                             f"found {unknown}")
        self.delays = delays if mode == "delayed" else {}  # an op's own delay, where it matters
        self._late = read_late(mode, self.shared, delay, self.delays)  # asked per op per subnet: once
        self._live = module
        self._versions: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # op -> step -> state after it
        self._private: dict[tuple[str, int], nn.Module] = {}  # (op, step) -> the module that subnet runs
        self._before: dict[str, list[torch.Tensor]] = {}  # ``step``: a delayed op's parameters before its update
        self.compensate(compensation, coef)

    def compensate(self, rule: str, coef: float = 1.0) -> None:
        """Set ``pipeline.delay_compensation`` (module doc), before the first subnet runs (the
        pipelined engine builds its instance before it is told)."""
        check_compensation(rule, coef)
        if self._versions or self._private:
            raise RuntimeError("SharedOps.compensate: expected before the first subnet, found versions kept")
        self.rule, self.coef = rule, float(coef)

    @property
    def _predict(self) -> bool:
        return self.rule == "predict" and self.mode == "delayed"

    @property
    def delayed(self) -> frozenset[str]:
        return self._late[0]

    @property
    def own_delays(self) -> dict[str, int]:
        return dict(self._late[1])

    def delay_of(self, op: str) -> int:
        return self.delays.get(op, self.delay)

    @property
    def frozen(self) -> frozenset[str]:
        return self.shared if self.mode == "frozen" else frozenset()

    def floor(self, step: int) -> int:
        return (step // self.every) * self.every if self.every else 0

    def reads(self, step: int, op: str) -> int:
        """The step whose update produced the version of delayed op ``op`` that ``step`` reads
        (``floor - 1``: the state at the checkpoint boundary)."""
        return max(step - self.delay_of(op), self.floor(step)) - 1

    def begin(self, op: str, step: int) -> None:
        """Subnet ``step`` is about to run ``op`` (owned here): for a delayed op, make its
        private copy of the version it reads; for a frozen one, of its only version."""
        if op in self.frozen:
            private = copy.deepcopy(self._live(op))
            for p in private.parameters():
                p.requires_grad_(False)
                p.grad = None
            self._private[(op, step)] = private
            return
        if op not in self.delayed:
            return
        live = self._live(op)
        versions = self._versions.setdefault(op, {})
        k = self.reads(step, op)
        if k not in versions:
            if k != self.floor(step) - 1:
                raise RuntimeError(f"shared op {op!r}: subnet of step {step} reads the version after step {k}, "
                                   f"which was not kept (kept: {sorted(versions)})")
            versions[k] = _snapshot(live)  # the state at the checkpoint boundary (start or resume)
        private = copy.deepcopy(live)
        private.load_state_dict(versions[k])
        for p in private.parameters():
            p.grad = None
        if self._predict:
            self._extrapolate(private, op, step, k)
        self._private[(op, step)] = private

    def _extrapolate(self, private: nn.Module, op: str, step: int, k: int) -> None:
        """``predict``: move the version read (after step ``k``) on along its last update, by the
        ``step - 1 - k`` updates it misses; nothing without an update since the boundary."""
        missed = step - 1 - k
        if missed <= 0 or k - 1 < self.floor(step) - 1:
            return
        prev = self._versions[op].get(k - 1)
        if prev is None:
            raise RuntimeError(f"shared op {op!r}: subnet of step {step} predicts from the versions after steps "
                               f"{k - 1} and {k}; {k - 1} was not kept (kept: {sorted(self._versions[op])})")
        now, alpha = self._versions[op][k], self.coef * missed
        with torch.no_grad():
            for name, p in private.named_parameters():
                v = now[name]
                p.copy_(v + alpha * (v - prev[name]))

    def module(self, op: str, step: int) -> nn.Module:
        """The module subnet ``step`` runs for ``op``."""
        private = self._private.get((op, step))
        return private if private is not None else self._live(op)

    @contextmanager
    def updating(self, ops: Sequence[str], step: int) -> Iterator[list[str]]:
        """Around the optimizer step of ``ops`` (subnet ``step``'s, on this process): yields the
        ops to step (never a frozen one). Before it, a delayed op's gradients and buffers go from
        its private copy to the live op; after it, a delayed op's new version is kept for the
        subnets that read it later."""
        for op in ops:
            self._take_private(op, step)
        stepping = self.rule == "step" and self.mode == "delayed"
        if stepping:
            for op in ops:
                if op in self.delayed:
                    self._before[op] = [p.detach().clone() for p in self._live(op).parameters()]
        yield [op for op in ops if op not in self.frozen]
        if stepping:
            with torch.no_grad():
                for op in ops:
                    for p, b in zip(self._live(op).parameters(), self._before.pop(op, ())):
                        p.copy_(b + self.coef * (p - b))  # the optimizer's step, scaled
        for op in ops:
            self._keep_version(op, step)

    def _take_private(self, op: str, step: int) -> None:
        private = self._private.pop((op, step), None)
        if private is None or op in self.frozen:
            return
        live = self._live(op)
        dc = self.rule == "dc" and op in self.delayed
        for p, q in zip(live.parameters(), private.parameters()):
            g = q.grad
            if dc and g is not None:  # DC-ASGD: g g^T as the Hessian's stand-in, times the weights' drift
                with torch.no_grad():
                    g = g + self.coef * (g * g * (p - q))
            p.grad = g
        with torch.no_grad():
            for b, c in zip(live.buffers(), private.buffers()):
                b.copy_(c)

    def _keep_version(self, op: str, step: int) -> None:
        if op not in self.delayed:
            return
        versions = self._versions.setdefault(op, {})
        versions[step] = _snapshot(self._live(op))
        oldest = step - self.delay_of(op) - (2 if self._predict else 1)  # ``predict`` reads one more
        for k in [k for k in versions if k < oldest]:
            del versions[k]

    def export_versions(self, op: str) -> dict[str, torch.Tensor]:
        """The kept versions of a delayed op leaving this process (they travel with its state,
        as ``version/<step>/<name>`` entries): a mid-graph shared op may change stage."""
        return {f"{VERSION}{k}/{name}": t for k, state in self._versions.get(op, {}).items() for name, t in state.items()}

    def adopt_versions(self, op: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the versions out of an arriving op's state (kept here); returns the rest."""
        rest = {}
        for key, t in state.items():
            if key.startswith(VERSION):
                k, name = key[len(VERSION):].split("/", 1)
                self._versions.setdefault(op, {}).setdefault(int(k), {})[name] = t
            else:
                rest[key] = t
        return rest

    def drop(self, op: str) -> None:
        """``op`` left this process."""
        self._versions.pop(op, None)
        for key in [k for k in self._private if k[0] == op]:
            del self._private[key]


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
