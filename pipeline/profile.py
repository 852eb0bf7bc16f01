"""The measured profiler: a :class:`~pipeline.plan.costs.CostTable` from timing every op on the job's device.

For each op of the supernet (every :class:`~supernet.OpSlot`, active or not) this runs the op
the way :mod:`supernet.execute` does — inputs as fresh leaves that require grad (the data
itself does not), :func:`supernet.ops.run_op`, then ``torch.autograd.backward`` with a random
gradient of the output — and records, at the micro-batch shape in use:

* ``fwd`` / ``bwd``: the median over ``repeats`` timed runs after ``warmup`` untimed ones
  (CUDA: ``torch.cuda.Event`` pairs and ``torch.cuda.synchronize``; CPU with one intra-op
  thread: the thread's CPU time, which other jobs on a shared machine do not inflate; CPU with
  more threads: ``perf_counter``; see :func:`clock_kind`),
  taken round robin over the distinct ops, with weight gradients accumulating between runs
  as they do over the micro-batches of a step;
* ``param_bytes`` (as :func:`~pipeline.plan.costs.analytic_costs` counts them) and
  ``optim_bytes`` (:func:`~pipeline.plan.costs.optim_bytes`);
* ``act_bytes``: what the forward keeps for the backward. On CPU: the unique storages of the
  tensors autograd saves (``saved_tensors_hooks``) plus the output's, minus the op's weights
  and its inputs (those are counted once, as the producer's output or as the stage's received
  cut). On CUDA: ``torch.cuda.memory_allocated`` after the forward minus before, with the
  output and the graph still alive (``max_memory_allocated`` over the same window, the
  transient peak, is logged at debug level);
* ``out_bytes`` per node: the bytes of its output, what crosses a cut.

Ops with the same :class:`~supernet.OpSpec` and the same input shapes share one measurement
(the layers of a chain space repeat the same few specs), so a 48 x 24 NASPipe space is 26
measurements.

Tables are cached on disk as JSON (written to a temp file, then ``os.replace``) in
``$PIPENAS_CACHE`` or ``~/.cache/pipenas``, keyed by a sha256 over the graph's structure
(op ids, nodes, inputs, specs), the device (type, name; thread count on CPU), the sample shape,
the micro-batch, the dtype, the optimizer and the torch version.

Distributed jobs must plan with ONE profile on every rank (the runtime checks that the ranks
agree on each plan): :func:`shared_profile` measures on rank 0 (or reads its cache) and
broadcasts the table with ``broadcast_object_list``. Call it after ``init_process_group`` and
pass the result to ``PipelineEngine(..., costs=table)``. The other ranks wait in the broadcast
meanwhile, so the process group's timeout must cover a first (uncached) measurement.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from supernet import INPUT, OpContext, SupernetError, SupernetGraph, build_op
from supernet.execute import input_needs_grad
from supernet.ops import run_op

from .files import atomic_write_text
from .plan.costs import CostTable, analytic_costs, graph_digest, kept_bytes, optim_bytes
from .plan.partition import OpCost

__all__ = ["ProfileError", "measured_costs", "shared_profile", "cost_table", "profile_key", "default_cache_dir",
           "clock_kind", "table_to_json", "table_from_json"]

log = logging.getLogger(__name__)
FORMAT = 3  # bump when the measurement method changes: old cache entries stop matching


class ProfileError(RuntimeError):
    """The profiler could not measure, or was called in a way it cannot serve."""


# ------------------------------------------------------------------------------ cache keys


def default_cache_dir() -> Path:
    return Path(os.environ.get("PIPENAS_CACHE") or Path.home() / ".cache" / "pipenas")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    # CPU op times depend on the intra-op thread count the job runs with.
    return f"{name} ({torch.get_num_threads()} threads)"


def profile_key(graph: SupernetGraph, sample_shape: Sequence[int], microbatch: int, optimizer: str,
                device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[str, dict[str, Any]]:
    """The cache key of a profile and the fields it hashes."""
    device = torch.device(device)
    fields = {
        "format": FORMAT, "graph": graph_digest(graph), "device": str(device.type),
        "device_name": _device_name(device), "sample_shape": [int(d) for d in sample_shape],
        "microbatch": int(microbatch), "dtype": str(dtype), "optimizer": optimizer,
        "torch": torch.__version__, "clock": clock_kind(device),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest(), fields


def table_to_json(table: CostTable) -> dict[str, Any]:
    return {
        "source": table.source, "microbatch": table.microbatch,
        "ops": {k: [c.fwd, c.bwd, c.param_bytes, c.optim_bytes, c.act_bytes] for k, c in table.ops.items()},
        "out_bytes": dict(table.out_bytes),
    }


def table_from_json(d: dict[str, Any]) -> CostTable:
    ops = {k: OpCost(k, float(v[0]), float(v[1]), int(v[2]), int(v[3]), int(v[4])) for k, v in d["ops"].items()}
    return CostTable(ops, {k: int(v) for k, v in d["out_bytes"].items()}, int(d["microbatch"]), str(d["source"]))


def _read_cache(path: Path, key: str) -> CostTable | None:
    try:
        d = json.loads(path.read_text())
        if d.get("key") != key:
            return None
        return table_from_json(d["table"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        log.warning("ignoring unreadable profile cache %s (%s); measuring again", path, e)
        return None


def _write_cache(path: Path, key: str, fields: dict[str, Any], table: CostTable) -> None:
    # atomic: a concurrent reader sees the old file or the new one
    atomic_write_text(path, json.dumps({"key": key, "fields": fields, "table": table_to_json(table)}))


# ---------------------------------------------------------------------------- measurement


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def clock_kind(device: torch.device) -> str:
    """How ops are timed: ``cuda-events`` on CUDA; on CPU with one intra-op thread, the calling
    thread's CPU time (``thread-cpu``: the op runs on that thread, and time other processes take
    the core is not counted, so a profile taken on a shared machine keeps its uncontended costs);
    with more threads, wall time (``wall``)."""
    if device.type == "cuda":
        return "cuda-events"
    return "thread-cpu" if torch.get_num_threads() == 1 else "wall"


class _Clock:
    """Seconds between ``start`` and ``stop`` (see :func:`clock_kind`)."""

    def __init__(self, device: torch.device) -> None:
        self.kind = clock_kind(device)
        self._now = time.thread_time if self.kind == "thread-cpu" else time.perf_counter

    def start(self) -> Any:
        if self.kind == "cuda-events":
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self._now()

    def stop(self, t0: Any) -> float:
        if self.kind == "cuda-events":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            return t0.elapsed_time(ev) / 1e3
        return self._now() - t0


def _kept_bytes_cuda(module: torch.nn.Module, args: list[torch.Tensor], ctx: OpContext) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run_op(module, args, ctx)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    log.debug("%s: kept %d bytes, transient peak %d bytes", ctx.op_id, kept, torch.cuda.max_memory_allocated() - base)
    del out
    return max(0, kept)


class _Unit:
    """One distinct measurement: an op module, its inputs and its timings so far."""

    def __init__(self, module: torch.nn.Module, inputs: list[torch.Tensor], needs_grad: list[bool],
                 ctx: OpContext) -> None:
        self.module, self.inputs, self.needs_grad, self.ctx = module, inputs, needs_grad, ctx
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.kept = 0

    def leaves(self) -> list[torch.Tensor]:
        return [a.detach().requires_grad_(True) if g else a for a, g in zip(self.inputs, self.needs_grad)]


def _run_once(unit: _Unit, clock: _Clock) -> tuple[float, float]:
    """One timed forward and backward. Weight gradients are kept between runs, so after the
    first run a backward accumulates into them, as micro-batches 2..M of a step do."""
    args = unit.leaves()
    t0 = clock.start()
    out = run_op(unit.module, args, unit.ctx)
    tf = clock.stop(t0)
    tb = 0.0
    if out.requires_grad:
        grad = torch.randn_like(out)
        t0 = clock.start()
        torch.autograd.backward(out, grad)
        tb = clock.stop(t0)
    return tf, tb


def _time_units(units: list[_Unit], device: torch.device, warmup: int, repeats: int) -> None:
    """Kept bytes, then ``warmup + repeats`` rounds over all units in turn (round robin, so a
    burst of load on a shared machine slows every op a little rather than a few ops a lot:
    the relative costs, which decide the partition, stay right)."""
    clock = _Clock(device)
    kept = _kept_bytes_cuda if device.type == "cuda" else kept_bytes
    for u in units:
        u.kept = kept(u.module, u.leaves(), u.ctx)
    for i in range(warmup + repeats):
        for u in units:
            tf, tb = _run_once(u, clock)
            if i >= warmup:
                u.fwd.append(tf)
                u.bwd.append(tb)
    for u in units:
        u.module.zero_grad(set_to_none=True)


def _measure(graph: SupernetGraph, sample_shape: tuple[int, ...], microbatch: int, optimizer: str,
             device: torch.device, dtype: torch.dtype, warmup: int, repeats: int, seed: int) -> CostTable:
    """Run and time every op of ``graph`` (see the module docstring); no cache."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((microbatch, *sample_shape), generator=gen).to(device=device, dtype=dtype)
    env: dict[str, torch.Tensor] = {INPUT: x}
    out_bytes = {INPUT: _nbytes(x)}
    slots_by_node: dict[str, list] = {}
    for slot in graph.slots():
        slots_by_node.setdefault(slot.node, []).append(slot)
    units: dict[tuple, _Unit] = {}
    unit_of: dict[str, tuple] = {}
    pbytes: dict[str, int] = {}
    torch.manual_seed(seed)  # torch.randn_like gradients: the same every run
    for node in graph.nodes():
        srcs = graph.inputs_of(node)
        args = [env[s] for s in srcs]
        needs_grad = [input_needs_grad(s, a) for s, a in zip(srcs, args)]  # as the engine runs the op
        shape = None
        for slot in slots_by_node[node]:
            module = build_op(slot.spec, slot.op_id, seed).to(device=device, dtype=dtype)
            ctx = OpContext(seed, 0, 0, slot.op_id, True)
            key = (slot.spec, tuple((tuple(a.shape), a.dtype) for a in args), tuple(needs_grad))
            if key not in units:
                units[key] = _Unit(module, args, needs_grad, ctx)
            unit_of[slot.op_id] = key
            with torch.no_grad():
                out = run_op(module, args, ctx)
            if shape is None:
                shape, env[node] = tuple(out.shape), out
            elif tuple(out.shape) != shape:
                raise SupernetError(
                    f"node {node!r}: every candidate must produce the same output shape; "
                    f"{slot.op_id!r} gives {tuple(out.shape)}, an earlier candidate gives {shape}")
            pbytes[slot.op_id] = sum(_nbytes(p) for p in module.parameters())
        out_bytes[node] = _nbytes(env[node])
    _time_units(list(units.values()), device, warmup, repeats)
    ops: dict[str, OpCost] = {}
    for op_id, key in unit_of.items():
        u = units[key]
        ops[op_id] = OpCost(op_id, statistics.median(u.fwd), statistics.median(u.bwd), pbytes[op_id],
                            optim_bytes(pbytes[op_id], optimizer), u.kept)
    log.info("profiled %d ops (%d distinct measurements) on %s", len(ops), len(units), device)
    return CostTable(ops, out_bytes, microbatch, f"measured:{device}")


# ---------------------------------------------------------------------------------- public


def measured_costs(graph: SupernetGraph, sample_shape: Sequence[int], microbatch: int, optimizer: str = "sgd",
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *, warmup: int = 2,
                   repeats: int = 7, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                   use_cache: bool = True) -> CostTable:
    """The measured cost table of ``graph`` at ``(microbatch, *sample_shape)`` on ``device``,
    from the cache when a profile with the same key exists (see the module docstring)."""
    device = torch.device(device)
    if device.type == "meta":
        raise ProfileError("measured_costs: the meta device cannot be timed; use pipeline.plan.costs.analytic_costs")
    if not (isinstance(microbatch, int) and microbatch >= 1) or repeats < 1 or warmup < 0:
        raise ProfileError(f"measured_costs: expected microbatch >= 1, repeats >= 1, warmup >= 0, found "
                           f"{microbatch!r}, {repeats!r}, {warmup!r}")
    sample_shape = tuple(int(d) for d in sample_shape)
    key, fields = profile_key(graph, sample_shape, microbatch, optimizer, device, dtype)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"profile-{key[:32]}.json"
    if use_cache:
        table = _read_cache(path, key)
        if table is not None:
            log.info("profile cache hit: %s", path)
            return table
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        table = _measure(graph, sample_shape, microbatch, optimizer, device, dtype, warmup, repeats, seed)
    if use_cache:
        _write_cache(path, key, fields, table)
    return table


def cost_table(source: str, graph: SupernetGraph, sample_shape: Sequence[int], microbatch: int,
               optimizer: str = "sgd", device: torch.device | str = "cpu", **kw: Any) -> CostTable:
    """``source="measured"``: :func:`measured_costs`; ``"analytic"``: the FLOP model
    :func:`~pipeline.plan.costs.analytic_costs` (the fallback: no device time, any size, any machine)."""
    if source == "measured":
        return measured_costs(graph, sample_shape, microbatch, optimizer, device, **kw)
    if source == "analytic":
        return analytic_costs(graph, tuple(sample_shape), microbatch, optimizer, **kw)
    raise ProfileError(f"cost source: expected 'measured' or 'analytic', found {source!r}")


def shared_profile(graph: SupernetGraph, sample_shape: Sequence[int], microbatch: int, optimizer: str,
                   rank: int, world_size: int, device: torch.device | str = "cpu", **kw: Any) -> CostTable:
    """One profile for every rank: rank 0 measures (or reads its cache), then broadcasts the table.

    Collective: every rank of the default process group calls it, after ``init_process_group``.
    ``world_size == 1`` measures locally. The broadcast is bounded by the process group's timeout.
    """
    if world_size == 1:
        return measured_costs(graph, sample_shape, microbatch, optimizer, device, **kw)
    import torch.distributed as dist  # the one collective here; measuring needs no process group

    if not dist.is_initialized():
        raise ProfileError("shared_profile: expected an initialized default process group (call "
                           "torch.distributed.init_process_group first), found none")
    device = torch.device(device)
    payload: list[Any] = [None]
    if rank == 0:
        payload[0] = table_to_json(measured_costs(graph, sample_shape, microbatch, optimizer, device, **kw))
    # NCCL moves the pickled object through the current CUDA device; gloo through CPU.
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    if payload[0] is None:
        raise ProfileError(f"shared_profile: rank {rank} received no table from rank 0")
    return table_from_json(payload[0])
