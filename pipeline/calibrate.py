"""Start-up calibration: the :class:`~pipeline.plan.overhead.RuntimeCosts` of the machine a job runs on.

What an op costs is the profile's (:mod:`pipeline.profile`); what a step costs around its ops
is measured here, in well under a second, once per machine (then cached like a profile):

* **the link**: ranks 0 and 1 ping-pong float32 messages of 4 B to 4 MiB over the process
  group (``repeats`` round trips per size, median / 2) and :func:`~pipeline.plan.overhead.fit_line`
  fits ``latency_s + bytes / bandwidth``;
* **an action**: the subnet's first op on one sample, forward and backward through
  :class:`~supernet.SliceRun` as the stage executor runs a slice, minus the same op's bare
  :func:`~supernet.ops.run_op` (the profile's measurement), halved, plus one message's latency:
  ``action_s``;
* **an update**: the run's optimizer stepping 1, then 8 small tensors, then one of 16 MiB:
  the fixed cost, the cost per op (at the graph's mean tensors per op) and per byte;
* **the subnet's collectives**: an all-reduce of one number (the agreement, the loss gather):
  ``step_s`` is two of them.

And, not cached (it is the machine's load, not its hardware), ``compute_scale``: every rank runs
the same small matmul loop at once and reports wall time over its thread's CPU time; the largest
is the factor a profile taken in CPU time (one thread) is slowed by when all ranks compute
together on shared cores (1.0 on idle cores, 2.0 when they get half a core each).

Collective: every rank of the default group calls :func:`runtime_costs` alike; rank 0 reads the
cache or measures (with rank 1 for the link) and broadcasts, so every rank plans with the same
figures. The cache (``$PIPENAS_CACHE`` or ``~/.cache/pipenas``, ``runtime-<key>.json``) is keyed
by the device (name, thread count), the backend, the world size, the torch version and the
optimizer (its update is what ``update_*`` time: an AdamW run must not price with SGD's figures).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from supernet import OpContext, SupernetGraph, build_op
from supernet.ops import run_op

from .files import atomic_write_text
from .plan.overhead import RuntimeCosts, fit_line
from .profile import _device_name, default_cache_dir

__all__ = ["runtime_costs", "cached_costs", "measure_link", "measure_local", "probe_contention", "FORMAT"]

log = logging.getLogger(__name__)
FORMAT = 3  # bump when the measurement changes: old cache entries stop matching (3: AdamW's fused CPU kernel)
LINK_BYTES = (4, 64 << 10, 1 << 20, 4 << 20)


def _median_time(fn, repeats: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_link(rank: int, peer: int, device: torch.device, sizes: Sequence[int] = LINK_BYTES, repeats: int = 7,
                 group=None) -> list[tuple[int, float]]:
    """Ping-pong between ``rank`` and ``peer`` (both call it, the lower rank sends first):
    per size in bytes, the median one-way seconds."""
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        first = rank < peer

        def once() -> None:
            if first:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)

        once()  # warm the connection and the allocator
        out.append((buf.numel() * 4, _median_time(once, repeats) / 2))
    return out


def measure_local(graph: SupernetGraph, sample_shape: Sequence[int], optimizer: Any, device: torch.device,
                  repeats: int = 15) -> dict[str, float]:
    """``action_s`` (less the message, added by the caller), ``update_s``, ``update_op_s`` and
    ``update_byte_s`` on this process (the module doc)."""
    from supernet.execute import SliceRun, cut
    from supernet.ops import op_contexts

    space = graph.space()
    active = graph.active_ops(space.validate({c.label: c.values[0] for c in space.choices}))
    sl = cut(active, [0, 1, len(active)], graph.output)[0]  # the subnet's first op, alone
    slot = next(s for s in graph.slots() if s.op_id == sl.ops[0].op_id)
    module = build_op(slot.spec, slot.op_id, 0).to(device)
    x = torch.randn((1, *sample_shape), generator=torch.Generator().manual_seed(0)).to(device)
    ctx = OpContext(0, 0, 0, slot.op_id, True)

    def bare() -> None:  # the op as the profile times it
        out = run_op(module, [x], ctx)
        torch.autograd.backward(out, torch.ones_like(out))

    def sliced() -> None:  # the same op as the stage executor runs a slice
        run = SliceRun(sl, lambda _op: module, op_contexts(0, 0, 0, True))
        outs = run.forward([x])
        run.backward([torch.ones_like(t) for t in outs])

    bare()
    sliced()
    bare_s = min(_median_time(bare, repeats) for _ in range(2))
    sliced_s = min(_median_time(sliced, repeats) for _ in range(2))
    action_s = max(0.0, sliced_s - bare_s) / 2  # per action: a forward or a backward

    def stepper(shapes: Sequence[int]):
        params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        return optimizer.build(params).step

    one = _median_time(stepper([16]), repeats)
    eight = _median_time(stepper([16] * 8), repeats)
    # larger than a cache level: a supernet's parameters are (1 MiB fitted in L2 here and priced
    # AdamW on the 8 MB transformer at a tenth of what it took)
    big_bytes = 16 << 20
    big = _median_time(stepper([big_bytes // 4]), 5)
    per_tensor = max(0.0, (eight - one) / 7)
    fixed = max(0.0, one - per_tensor)
    per_byte = max(0.0, (big - one) / big_bytes)
    tensors = [sum(1 for _ in build_op(s.spec, s.op_id, 0).parameters()) for s in list(graph.slots())[:32]]
    per_op = per_tensor * (sum(tensors) / len(tensors) if tensors else 1.0)
    return {"action_s": action_s, "update_s": fixed, "update_op_s": per_op, "update_byte_s": per_byte}


def probe_contention(device: torch.device, seconds: float = 0.05) -> float:
    """Wall over CPU seconds of a small single-threaded matmul loop on this process (1.0 when
    it had a core to itself). CPU with one intra-op thread only; 1.0 elsewhere."""
    if device.type != "cpu" or torch.get_num_threads() != 1:
        return 1.0
    x = torch.randn(96, 96, generator=torch.Generator().manual_seed(0))
    w0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - w0 < seconds:
        for _ in range(20):
            x = torch.tanh(x @ x / 96)
    return (time.perf_counter() - w0) / max(time.thread_time() - c0, 1e-9)


def _key(device: torch.device, backend: str, world_size: int, optimizer: str) -> tuple[str, dict[str, Any]]:
    fields = {"format": FORMAT, "device": device.type, "device_name": _device_name(device), "backend": backend,
              "world_size": world_size, "torch": torch.__version__, "optimizer": optimizer}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest(), fields


def _path(device: torch.device, backend: str, world_size: int, optimizer: str,
          cache_dir) -> tuple[Path, str, dict[str, Any]]:
    key, fields = _key(device, backend, world_size, optimizer)
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"runtime-{key[:32]}.json", key, fields


def _read(path: Path, key: str) -> RuntimeCosts | None:
    try:
        d = json.loads(path.read_text())
        return RuntimeCosts.from_json(d["costs"]) if d.get("key") == key else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable runtime-cost cache %s (%s); measuring again", path, e)
        return None


def cached_costs(device: torch.device | str, backend: str, world_size: int, optimizer: str,
                 cache_dir: str | os.PathLike | None = None) -> RuntimeCosts:
    """The runtime costs cached for this machine (a job of ``world_size`` ranks on ``backend``
    training with ``optimizer``), else the assumed defaults (``source="assumed"``); measures
    nothing (reports use it)."""
    path, key, _ = _path(torch.device(device), backend, world_size, optimizer, cache_dir)
    return _read(path, key) or RuntimeCosts()


def runtime_costs(graph: SupernetGraph, sample_shape: Sequence[int], optimizer: Any, rank: int, world_size: int,
                  device: torch.device, *, cache_dir: str | os.PathLike | None = None,
                  use_cache: bool = True) -> RuntimeCosts:
    """This machine's runtime costs, the same on every rank (collective; the module doc).
    ``optimizer``: the run's :class:`~pipeline.memory.OptimConfig`."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    many = world_size > 1 and dist.is_initialized()
    backend = dist.get_backend() if many else "none"
    path, key, fields = _path(device, backend, world_size, optimizer.name, cache_dir)
    box: list[Any] = [None]
    if rank == 0 and use_cache:
        cached = _read(path, key)
        box[0] = cached.to_json() if cached is not None else None
    bdev = device if device.type == "cuda" else None
    if many:
        dist.broadcast_object_list(box, src=0, device=bdev)
    if box[0] is None:
        link = measure_link(rank, 1 - rank, device) if many and rank in (0, 1) else []
        if many:
            dist.barrier()
        flag = torch.zeros(1, device=device)
        if rank == 0:
            local = measure_local(graph, sample_shape, optimizer, device)
            latency, bandwidth = 0.0, 1e12
            if link:
                latency, per_byte = fit_line([b for b, _ in link], [s for _, s in link])
                bandwidth = 1.0 / per_byte if per_byte > 0 else 1e12
            step_s = 2 * _median_time(lambda: dist.all_reduce(flag), 7) if many else 0.0
            costs = RuntimeCosts(action_s=local["action_s"] + latency, update_s=local["update_s"],
                                 update_op_s=local["update_op_s"], update_byte_s=local["update_byte_s"],
                                 step_s=step_s, latency_s=latency, bandwidth=bandwidth, source="measured")
            if use_cache:
                atomic_write_text(path, json.dumps({"key": key, "fields": fields, "costs": costs.to_json()}))
            box[0] = costs.to_json()
        elif many:
            for _ in range(7):  # rank 0's timed all-reduces
                dist.all_reduce(flag)
        if many:
            dist.broadcast_object_list(box, src=0, device=bdev)
    costs = RuntimeCosts.from_json(box[0])
    # the machine's load now: every rank computes at once, the slowest sets the scale
    if many:
        dist.barrier()
    scale = torch.tensor([probe_contention(device)], dtype=torch.float64, device=device)
    if many:
        dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    costs = replace(costs, compute_scale=round(float(scale.item()), 3))
    if rank == 0:
        log.info("runtime costs (%s, %.2f s): action %.0f us, update %.0f us + %.1f us/op, link %.0f us + %.2f GB/s, "
                 "subnet collectives %.0f us, compute x%.2f", costs.source, time.perf_counter() - t0,
                 1e6 * costs.action_s, 1e6 * costs.update_s, 1e6 * costs.update_op_s, 1e6 * costs.latency_s,
                 costs.bandwidth / 1e9, 1e6 * costs.step_s, costs.compute_scale)
    return costs
