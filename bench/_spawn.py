"""Benchmark helpers: run a function in P spawned gloo ranks (file rendezvous, timeout), measure
the gloo loopback link, and write a benchmark's JSON lines to stdout and ``bench/out/``.

``spawn(world, "bench.some_module:worker", spec)`` starts ``world`` processes of this file; each
initialises gloo with a file rendezvous, sets one intra-op thread (or ``spec["threads"]``), calls
``worker(spec, rank, world)`` and rank 0's return value (plain JSON data) comes back. The pattern
is the one of ``tests/distributed.py``; a rank that fails or overruns the timeout stops the run
with its stderr in the message, and every process is killed on the way out.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def emit(name: str, rows: list[dict]) -> None:
    """Print one JSON line per row to stdout and write the same lines to ``bench/out/<name>.jsonl``."""
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, sort_keys=False) for r in rows]
    tmp = OUT / f"{name}.jsonl.tmp"
    tmp.write_text("".join(ln + "\n" for ln in lines))
    os.replace(tmp, OUT / f"{name}.jsonl")
    for ln in lines:
        print(ln, flush=True)


QUIET = 1.10  # a step whose compute took <= 10 % more wall time than CPU time ran undisturbed


def contention(busy_s: float, cpu_s: float) -> float:
    """Wall seconds of compute per CPU second the process got: ~1 on an idle machine, above 1
    when other processes took the core (this machine is shared with other jobs). ``cpu_s``
    also counts the process's planning and messaging, so an undisturbed step reads a bit below 1."""
    return busy_s / max(cpu_s, 1e-9)


def measured_step(engine, step: int, arch, x, y, lookahead) -> tuple[Any, list[dict]]:
    """One pipelined training step as the benchmarks time it: the ranks start together, the
    engine gets the sampler's lookahead (as the app gives it), and every rank's figures come
    back, rank by rank: ``wall_s``, ``busy_s`` (compute), ``cpu_s`` (the process's CPU time),
    ``migration_s`` (the migration on the critical path), ``max_in_flight``, ``migrated_ops``,
    ``migrated_bytes``."""
    import torch.distributed as dist

    dist.barrier()
    c0 = time.process_time()
    engine.plan_ahead(lookahead)
    result = engine.train_step(step, arch, x, y)
    cpu = time.process_time() - c0
    st = engine.stats
    mine = {"wall_s": st.wall_s, "busy_s": st.busy_s, "cpu_s": cpu, "migration_s": st.migration_s,
            "max_in_flight": st.max_in_flight, "migrated_ops": st.migrated_ops, "migrated_bytes": st.migrated_bytes}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return result, ranks


def progress(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def python_path(tree: Path = ROOT) -> str:
    """``PYTHONPATH`` for a child run of ``tree``: the tree first, then what the caller's path
    holds (packages carried beside a machine's own, as on the GPU machines)."""
    return os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))


def search_command(nproc: int) -> list[str]:
    """``python -m search`` in ``nproc`` processes, launched as a user launches it (torchrun above one)."""
    if nproc == 1:
        return [sys.executable, "-m", "search"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "search"]


def run_env(tree: Path = ROOT) -> dict[str, str]:
    """The environment of a child run of ``tree``: this process's, less a torchrun rank's identity
    and a planted fault, with one intra-op thread and the tree first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PIPENAS_FAULT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=python_path(tree))


def spawn(world: int, target: str, spec: dict, timeout_s: float = 600.0) -> Any:
    """Run ``target`` (``"module:function"``) in ``world`` gloo ranks; rank 0's result."""
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-bench-"))
    full = dict(spec, target=target, rendezvous=str(tmp / "rdzv"), out=str(tmp / "out.json"))
    (tmp / "spec.json").write_text(json.dumps(full))
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   PYTHONPATH=python_path(),
                   OMP_NUM_THREADS=str(spec.get("threads", 1)),
                   # OpenMP threads that spin while they wait make a 2-thread run several times
                   # slower than 1 thread on a machine shared with other jobs: let them sleep
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__)), str(tmp / "spec.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT)))
    t0 = time.monotonic()
    errors = []
    try:
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                errors.append(f"rank {rank} did not finish within {timeout_s:g} s")
                break
            if p.returncode != 0:
                errors.append(f"rank {rank} exited {p.returncode}:\n{err[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if errors:
        raise RuntimeError(f"{target} in {world} ranks failed: " + "\n".join(errors))
    return json.loads(Path(full["out"]).read_text())


def measure_link(rank: int, sizes: tuple[int, ...] = (1 << 10, 1 << 22), repeats: int = 25) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the rank 0 <-> 1 link as the runtime uses it: one
    ``pipeline.transport.Transport`` message of one float32 tensor (a header message, then the
    payload), one way = half a ping-pong round trip, median over ``repeats``, least-squares
    modelled as ``latency + bytes / bandwidth``. Collective over ranks 0 and 1; rank 0's fit is
    broadcast so that every rank plans with the same numbers."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from pipeline.transport import Transport

    tr = Transport(rank, torch.device("cpu"), 60.0)
    times = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)
        samples = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                tr.send([buf], 1)
                tr.recv(1)
            elif rank == 1:
                tr.recv(0)
                tr.send([buf], 0)
            if i >= 2:
                samples.append((time.perf_counter() - t0) / 2)
            tr.flush()
        times.append(float(np.median(samples)))
    # latency: the smallest message; bandwidth: the slope between the smallest and the largest
    # (a least-squares fit over all sizes is at the mercy of one noisy middle point on a busy box)
    slope = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
    fit = torch.tensor([max(times[0], 1e-6), 1.0 / slope if slope > 0 else float(np.inf)], dtype=torch.float64)
    dist.broadcast(fit, 0)
    return float(fit[0]), float(fit[1])


def measure_interference(rank: int, work, rounds: int = 6, repeats: int = 8) -> dict:
    """How much slower rank 0 runs ``work()`` while rank 1 runs it too than while rank 1 waits:
    on a machine whose cores share caches, memory bandwidth or a physical core, a balanced
    pipeline (both stages busy at once) computes slower than the per-op profile (one process
    alone) says. Alone and together alternate for ``rounds`` rounds (this VM's speed drifts);
    collective over all ranks; returns rank 0's median slowdown over the rounds and its range."""
    import statistics

    import torch.distributed as dist

    def timed() -> float:
        t0 = time.perf_counter()
        work()
        return time.perf_counter() - t0

    work()  # warm up
    ratios = []
    for _ in range(rounds):
        dist.barrier()
        alone = [timed() for _ in range(repeats)] if rank == 0 else []
        dist.barrier()
        together = [timed() for _ in range(repeats)]
        dist.barrier()
        if rank == 0:
            ratios.append(statistics.median(together) / statistics.median(alone))
    if rank != 0:
        return {}
    return {"slowdown": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": rounds}


def link_worker(spec: dict, rank: int, world: int) -> dict:
    """``spawn(2, "bench._spawn:link_worker", {})``: the fitted gloo loopback link."""
    latency, bandwidth = measure_link(rank)
    return {"latency_s": latency, "bandwidth": bandwidth}


def _worker() -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    dist.init_process_group("gloo", init_method=f"file://{spec['rendezvous']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(spec.get("timeout_s", 300))))
    module, fn = spec["target"].split(":")
    result = getattr(importlib.import_module(module), fn)(spec, rank, world)
    if rank == 0:
        tmp = Path(spec["out"]).with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, spec["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker()
