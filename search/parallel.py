"""How the search scores its candidate archs: through the run's engine one arch at a time, or in
parallel on every process (``search.parallel``).

Scoring archs is embarrassingly parallel, but a pipelined evaluation (``Engine.evaluate`` under
torchrun) runs one arch at a time over all stages. :class:`ParallelScoring` instead gives every
rank the trained supernet's weights (broadcast from rank 0, which holds them after training),
builds on each rank the engine a one-process run scores with
(:class:`pipeline.reference.ReferenceEngine`), and lets each rank score its share of a batch
(round-robin by index: rank r scores archs r, r + N, ...). The results are gathered so that every
rank holds all of them in the batch's order, and the search goes on alike everywhere. Each
arch is scored by the one-process computation (batch norm recalibrated on the same batches), so
the scores are the one-process run's bit for bit.

:func:`choose` decides (pure): ``false`` or one process: the engine; ``true``: in parallel;
``auto``: in parallel unless the tensor manager has a device budget (a process may not hold the
whole supernet) or there is a single arch to score; on CUDA ``auto`` also needs every rank's free
device memory to hold twice the supernet's weights (checked once the sizes are known, by every
rank alike). Replicated stages need nothing special: rank 0 (replica 0) gathers the weights as
for a checkpoint and every rank gets them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeline import Engine, EvalResult, ReferenceEngine
from pipeline.memory.state import weights_only
from pipeline.transport import peer_errors
from supernet import Arch, SupernetGraph

from .config import RunConfig

__all__ = ["Scoring", "EngineScoring", "ParallelScoring", "Choice", "choose", "open_scoring", "broadcast_states",
           "ARCHS_PER_RANK"]

ARCHS_PER_RANK = 8  # archs a rank scores between two gathers (and stop votes) at most
HEADROOM = 2.0  # auto on CUDA: free device memory must hold this many times the supernet's weights

OpStates = Mapping[str, Mapping[str, torch.Tensor]]


class Scoring(Protocol):
    """Scores batches of archs; every rank calls it with the same archs and gets the same results."""

    chunk: int  # archs per call at most: the search votes on a stop between calls

    def __call__(self, archs: Sequence[Arch], val: list, calib: list,
                 before: Callable[[], None] | None = None) -> list[EvalResult]:
        """The archs' results in order. ``before``: called first, inside the scoring's failure
        report (the search's stop vote and injected faults)."""

    def close(self) -> None: ...


class EngineScoring:
    """One arch at a time through the run's engine (one process, or pipelined over all stages)."""

    chunk = 1

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, archs: Sequence[Arch], val: list, calib: list,
                 before: Callable[[], None] | None = None) -> list[EvalResult]:
        if before is not None:
            before()
        return [self.engine.evaluate(arch, val, calib) for arch in archs]

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Choice:
    """Which scoring a run uses, and why (the main rank logs it)."""

    parallel: bool
    reason: str


def choose(setting: bool | str, world_size: int, budget: bool, archs: int) -> Choice:
    """The scoring for ``search.parallel`` (``setting``: ``"auto"``, ``True`` or ``False``) in a
    world of ``world_size`` ranks, with a tensor-manager device budget or not (``budget``), for a
    search of ``archs`` archs. Pure; :func:`open_scoring` adds the CUDA memory check of ``auto``."""
    if world_size == 1:
        return Choice(False, "one process")
    if setting is False:
        return Choice(False, "search.parallel=false")
    if setting is True:
        return Choice(True, "search.parallel=true" + (", each rank within memory's device budget" if budget else ""))
    if budget:
        return Choice(False, "search.parallel=auto with a device budget (memory.device_budget_bytes or "
                             "device_budget_fraction): one process may not hold the whole supernet; "
                             "search.parallel=true scores on every process within that budget")
    if archs < 2:
        return Choice(False, "search.parallel=auto with a single arch to score")
    return Choice(True, "search.parallel=auto")


@contextmanager
def _failing(engine: Engine, what: str) -> Iterator[None]:
    """The engine's failure report around a collective step (a pipelined engine's reporter: the
    failing rank leaves its note, and peers that lose it quote that note), else nothing."""
    failures = getattr(engine, "failures", None)
    with failures.failing(-1, what) if failures is not None else nullcontext():
        yield


def broadcast_states(states: OpStates | None, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """Every op's weights and buffers (``states`` on rank 0, optimizer entries left out) on every
    rank (collective, default group): the layout as one object, then one flat tensor per dtype.
    ``device``: where the flat tensors travel (the rank's device on NCCL, else the CPU)."""
    rank = dist.get_rank()
    weights = {op: weights_only(s) for op, s in states.items()} if rank == 0 and states is not None else None
    layout: list[Any] = [None]
    if rank == 0:
        if weights is None:
            raise ValueError("search.parallel: rank 0 has no op states to broadcast (expected the trained "
                             "supernet's, found None)")
        layout[0] = [(op, key, tuple(t.shape), t.dtype) for op, s in weights.items() for key, t in s.items()]
    with peer_errors("sending the supernet's layout to every rank"):
        dist.broadcast_object_list(layout, src=0)
    at = torch.device("cpu") if dist.get_backend() != "nccl" else device
    dtypes = sorted({dtype for *_, dtype in layout[0]}, key=str)
    flats = {}
    for dtype in dtypes:
        entries = [(op, key, shape) for op, key, shape, dt in layout[0] if dt == dtype]
        if weights is not None:
            flat = torch.cat([weights[op][key].reshape(-1) for op, key, _ in entries]).to(at)
        else:
            flat = torch.empty(sum(math.prod(shape) for *_, shape in entries), dtype=dtype, device=at)
        with peer_errors(f"broadcasting the supernet's {dtype} tensors"):
            dist.broadcast(flat, src=0)
        if weights is None:
            flats[dtype] = (flat.cpu(), entries)
    if weights is not None:  # rank 0: its own tensors (the same bytes)
        return weights
    out: dict[str, dict[str, torch.Tensor]] = {}
    for flat, entries in flats.values():
        offset = 0
        for op, key, shape in entries:
            n = math.prod(shape)
            out.setdefault(op, {})[key] = flat[offset:offset + n].view(shape)
            offset += n
    return out


def _state_bytes(states: OpStates) -> int:
    return sum(t.numel() * t.element_size() for s in states.values() for t in s.values())


def _free_bytes(device: torch.device) -> int:
    """What this process may still allocate on a CUDA device: free memory plus what torch's
    caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class ParallelScoring:
    """Each rank scores its share of every batch with its own one-process engine holding the
    whole supernet's weights; the results are gathered in the batch's order on every rank."""

    def __init__(self, engine: Engine, reference: ReferenceEngine) -> None:
        self.engine, self.reference = engine, reference
        self.rank, self.world_size = engine.rank, engine.world_size
        self.chunk = self.world_size * ARCHS_PER_RANK

    def __call__(self, archs: Sequence[Arch], val: list, calib: list,
                 before: Callable[[], None] | None = None) -> list[EvalResult]:
        # a failure here leaves the engine's note and skips its closing barrier: the other ranks,
        # waiting in the gather, lose this one and quote the note instead of hanging
        with _failing(self.engine, "evaluate"):
            if before is not None:
                before()
            share = range(self.rank, len(archs), self.world_size)  # round-robin: archs r, r + N, ...
            mine = [self.reference.evaluate(archs[i], val, calib) for i in share]
            gathered: list[Any] = [None] * self.world_size
            with peer_errors("gathering the scores of the other ranks' archs"):
                dist.all_gather_object(gathered, mine)
        out: list[EvalResult | None] = [None] * len(archs)
        for r, results in enumerate(gathered):
            out[r::self.world_size] = results
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.reference.close()


def open_scoring(rc: RunConfig, engine: Engine, graph: SupernetGraph, states: OpStates | None, archs: int,
                 log: Callable[[str], None]) -> Scoring:
    """The scoring this run's search uses (collective when the world has several ranks and
    :func:`choose` allows parallel scoring: every rank calls it alike). ``states``: the trained
    supernet's op states on rank 0 (``None`` elsewhere). ``log``: the main rank's log line saying
    which scoring is used and why."""
    choice = choose(rc.search.parallel, engine.world_size, rc.memory.virtual, archs)
    if not choice.parallel:
        if engine.world_size > 1:
            log(f"search: pipelined scoring, one arch at a time over all stages ({choice.reason})")
        return EngineScoring(engine)
    device: torch.device = getattr(engine, "device", torch.device("cpu"))
    # inside the engine's failure report: a rank that fails here (a budget too small for the
    # supernet, no memory) leaves its note and its peers, waiting for it, quote that note
    with _failing(engine, "search-weights"):
        weights = broadcast_states(states if engine.rank == 0 else None, device)
        if rc.search.parallel == "auto" and device.type == "cuda":
            need = int(HEADROOM * _state_bytes(weights))
            free: list[Any] = [None] * engine.world_size
            with peer_errors("gathering the ranks' free device memory"):
                dist.all_gather_object(free, _free_bytes(device))
            short = [r for r, b in enumerate(free) if b < need]
            if short:
                log(f"search: pipelined scoring, one arch at a time over all stages (search.parallel=auto: ranks "
                    f"{short} have less free device memory than {HEADROOM:g} x the supernet's weights, {need} bytes; "
                    f"free by rank: {free})")
                return EngineScoring(engine)
        # the engine a one-process run scores with; only its weights and buffers matter here
        reference = ReferenceEngine(graph, rc.seed, rc.train.optimizer, rc.train.microbatches, rc.train.schedule(),
                                    device, memory=rc.memory if rc.memory.virtual else None)
        try:
            reference.load_op_states(weights)
        except BaseException:
            reference.close()
            raise
    log(f"search: scoring on every process ({choice.reason}): {engine.world_size} ranks, each a share of every "
        f"batch with a one-process engine holding the supernet's weights (broadcast from rank 0)")
    return ParallelScoring(engine, reference)
