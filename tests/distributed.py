"""Helpers for multi-process gloo tests: spawn P ranks with a file rendezvous and a timeout.

Each worker runs a list of scenarios (several checks per spawn, because process start-up
dominates on small machines) and rank 0 writes the results as JSON for the test to compare
against the single-process reference computed in the test process.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SPACES = {
    "transformer": dict(layers=6, width=32, candidates=["attn2", "ffn4", "conv3", "identity"], dropout=0.1),
    "conv": dict(layers=4, channels=8),
    "cell": dict(cells=3, channels=4),
    "resmlp": dict(),  # a fixed op ("transition") mid-graph, which changes stage between subnets at P = 2
}


@dataclass(frozen=True)
class Scenario:
    space: str
    schedule: str
    steps: int = 4
    microbatches: int = 4
    batch: int = 16
    optimizer: str = "sgd"
    planner: str = "dynamic"
    seed: int = 0
    eval_archs: int = 0
    start: int = 0  # first step to run (a resumed run starts after its checkpoint)
    stop: int | None = None  # stop before this step (None: run to ``steps``, the lr schedule's length)
    load: str = ""  # checkpoint of op states to resume from
    save: str = ""  # where rank 0 saves the final op states
    extra: dict = field(default_factory=dict)
    plan_ahead: bool = True  # give the engine the next subnets, as the app does with the sampler's peek
    memory: dict = field(default_factory=dict)  # MemorySettings fields (a device budget per stage)
    trace_steps: tuple = ()  # steps whose spans are recorded (results: "spans", every rank's, on rank 0)
    diverge_rank: int = -1  # this rank samples another arch stream from step ``diverge_at`` on
    diverge_at: int = 0
    segment: int = 0  # > 0: hand the engine this many steps at once (train_steps), as the app does
    checkpoint_every: int = 0  # where checkpoint boundaries fall (delayed shared ops restart there)
    sampler: str = "random"  # random (seeded uniform draws) or a search.samplers name (uniform, fair)
    order: str = "stream"  # the search.samplers sampler's order (stream or locality)
    clip: float | None = None  # train.clip_grad_norm (None: off)


def build_graph(space: str):
    from supernet.spaces import build_space

    return build_space(space, input_shape=(1, 8, 8), num_classes=10, **SPACES[space])


def step_data(seed: int, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def arch_stream(graph, seed: int, n: int, sampler: str = "random", order: str = "stream"):
    space = graph.space()
    if sampler != "random":
        from search.samplers import make_sampler

        s = make_sampler(sampler, space, seed, order=order)
        return [s.next() for _ in range(n)]
    rng = random.Random(seed)
    return [space.random(rng) for _ in range(n)]


def make_engine(sc: Scenario, graph, env=None):
    from pipeline import LrSchedule, OptimConfig, PipelineSettings, create_engine
    from pipeline.memory import MemorySettings

    optim = OptimConfig(name=sc.optimizer, lr=0.05 if sc.optimizer == "sgd" else 3e-3, momentum=0.9, weight_decay=1e-4)
    lr = LrSchedule(optim.lr, sc.steps, "cosine", warmup_steps=1)
    settings = PipelineSettings(schedule=sc.schedule, planner=sc.planner, timeout_s=30.0, **sc.extra)
    memory = MemorySettings(**sc.memory) if sc.memory else None
    return create_engine(graph, sc.seed, optim, sc.microbatches, lr, settings, device="cpu", env=env, memory=memory,
                         trace_steps=tuple(sc.trace_steps), checkpoint_every=sc.checkpoint_every,
                         clip_grad_norm=sc.clip, batch_size=sc.batch, sample_shape=(1, 8, 8))  # step_data's


def run_scenario(sc: Scenario, env=None) -> dict:
    """Train ``sc.steps`` steps (and evaluate ``sc.eval_archs`` archs); results as plain data."""
    from pipeline import params_digest

    graph = build_graph(sc.space)
    engine = make_engine(sc, graph, env)
    if os.environ.get("PIPENAS_TEST_BATCHED") and hasattr(engine, "executor"):
        # NCCL's way on gloo (batch_isend_irecv runs on both): receives posted at need or in one
        # batch with the sends before them, the CPU stand-in for the CUDA path
        engine.executor.transport.batched = True
    archs = arch_stream(graph, sc.seed, sc.steps + sc.eval_archs, sc.sampler, sc.order)
    if env is not None and env.rank == sc.diverge_rank:  # a misconfigured rank (agreement tests)
        archs[sc.diverge_at:] = arch_stream(graph, sc.seed + 1, len(archs) - sc.diverge_at)
    if sc.load:
        engine.load_op_states(torch.load(sc.load, weights_only=True))
    losses, mb_losses, migrated, peaks, ahead, early, bounds = [], [], 0, 0, 0, 0, []
    resident_peak, evictions, swapped, recomputed, overlapped = 0, 0, 0, 0, 0
    hits, host_updates, arrived = 0, 0, 0
    end = sc.steps if sc.stop is None else sc.stop

    def results():
        if sc.segment:  # as the app does: segments of steps, the next subnets as the lookahead
            for first in range(sc.start, end, sc.segment):
                items = [(k, archs[k], *step_data(sc.seed, k, sc.batch)) for k in range(first, min(end, first + sc.segment))]
                yield from engine.train_steps(items, archs[items[-1][0] + 1: items[-1][0] + 3])
            return
        for step in range(sc.start, end):
            x, y = step_data(sc.seed, step, sc.batch)
            if sc.plan_ahead:
                engine.plan_ahead(archs[step + 1 : step + 3])  # as the app does with the sampler's peek
            yield engine.train_step(step, archs[step], x, y)

    for r in results():
        bounds.append(list(getattr(getattr(engine, "stats", None), "bounds", ())))
        ahead += bool(getattr(getattr(engine, "stats", None), "planned_ahead", False))
        early = max(early, getattr(getattr(engine, "stats", None), "early_migrated_ops", 0))  # over the run
        losses.append(r.loss)
        mb_losses.append(list(r.microbatch_losses))
        migrated += r.migrated_ops
        peaks = max(peaks, getattr(getattr(engine, "stats", None), "max_in_flight", 0))
        swapped += getattr(getattr(engine, "stats", None), "swapped_bytes", 0)
        recomputed += getattr(getattr(engine, "stats", None), "recomputed_ops", 0)
        overlapped = max(overlapped, getattr(getattr(engine, "stats", None), "overlapped", 0))
        if r.memory is not None:
            resident_peak, evictions = max(resident_peak, r.memory.resident_bytes_peak), evictions + r.memory.evictions
            hits, host_updates = hits + r.memory.hits, host_updates + r.memory.host_updates
            arrived += r.memory.arrived
    evals = []
    for i in range(sc.eval_archs):
        xv, yv = step_data(sc.seed + 7, i, sc.batch)
        xc, yc = step_data(sc.seed + 9, i, sc.batch)
        e = engine.evaluate(archs[sc.steps + i], [(xv, yv), (xv.flip(0), yv.flip(0))], [(xc, yc)])
        evals.append([e.loss, e.correct, e.total])
    spans = engine.trace_spans() if sc.trace_steps else None
    tier = getattr(engine, "peer", None)  # the peer tier: what this rank handed to its pair / held for it
    peered = tier.client.fetched_bytes if tier is not None and tier.client is not None else 0
    peer_held = tier.server.peak_bytes if tier is not None and tier.server is not None else 0
    round_trips = getattr(getattr(engine, "agreement", None), "round_trips", 0)
    states = engine.op_states()
    if sc.save and states is not None:
        torch.save(states, sc.save)
    return {
        "losses": losses, "mb_losses": mb_losses, "evals": evals,
        "digest": params_digest(states) if states is not None else None,
        "migrated": migrated, "peak_in_flight": peaks, "resident_peak": resident_peak, "evictions": evictions,
        "swapped": swapped, "recomputed": recomputed, "peered": peered, "peer_held": peer_held, "overlapped": overlapped, "hits": hits, "host_updates": host_updates, "arrived": arrived, "planned_ahead": ahead, "early_migrated": early, "bounds": bounds, "agreement_round_trips": round_trips,
        "spans": [list(dataclasses.astuple(sp)) for sp in spans] if spans else None,
        "host_rate": engine.tensors.measured_host_rate,  # memory.host_update_rate: auto, as measured (None: not)
        "engine": engine,
    }


_ONE_PROCESS: dict[str, dict] = {}


def one_process(sc: Scenario) -> dict:
    """``sc`` run in this process, one intra-op thread, results as plain data (no engine); run
    once per scenario and shared by every test that asks (the tests only read it)."""
    key = repr(sc)
    if key not in _ONE_PROCESS:
        torch.set_num_threads(1)
        res = run_scenario(sc)
        res.pop("engine")
        _ONE_PROCESS[key] = res
    return _ONE_PROCESS[key]


def assert_same_as_reference(got: dict, ref: dict, label: str) -> None:
    """A run computed what the single-process reference computed: every step's and micro-batch's
    loss, every evaluation and the final weights, bit for bit."""
    assert got["losses"] == ref["losses"], f"{label}: step losses differ"
    assert got["mb_losses"] == ref["mb_losses"], f"{label}: micro-batch losses differ"
    assert got["evals"] == ref["evals"], f"{label}: evaluations differ"
    assert got["digest"] == ref["digest"], f"{label}: final params_digest differs"


def _worker() -> None:
    """Entry point of a spawned rank: ``python tests/distributed.py <spec.json>``."""
    import torch.distributed as dist

    from pipeline import DistEnv
    from pipeline.eager import skip_dynamo

    skip_dynamo()  # as the app's processes do (search.app.prepare): no torch._dynamo import
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['rendezvous']}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    env = DistEnv(rank, world, rank)
    results = []
    for raw in spec["scenarios"]:
        sc = Scenario(**raw)
        res = run_scenario(sc, env)
        engine = res.pop("engine")
        peaks = [None] * world
        dist.all_gather_object(peaks, engine.stats.max_in_flight)
        res["peak_in_flight"] = peaks
        mem: list = [None] * world
        gathered = ("resident_peak", "evictions", "swapped", "recomputed", "hits", "host_updates", "arrived", "peered",
                    "peer_held", "host_rate")
        dist.all_gather_object(mem, tuple(res[key] for key in gathered))
        for k, key in enumerate(gathered):
            res[key] = [m[k] for m in mem]
        results.append(res)
    if rank == 0:
        tmp = Path(spec["out"]).with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        os.replace(tmp, spec["out"])
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the CLI does under torchrun: no interpreter finalization with gloo threads about


def spawn(world: int, scenarios: list[Scenario], timeout_s: float = 240.0, env_extra: dict | None = None,
          expect_ok: bool = True) -> tuple[list[dict] | None, list[subprocess.CompletedProcess | None], float]:
    """Run ``world`` ranks of ``_worker`` on ``scenarios``; returns (rank-0 results, processes, seconds)."""
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-dist-"))
    spec = {"rendezvous": str(tmp / "rdzv"), "out": str(tmp / "out.json"),
            "scenarios": [asdict(s) for s in scenarios]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    from tests.cli_driver import child_env
    from tests.zygote import collect, launch

    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        env = child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                        PIPENAS_FAILURE_DIR=str(tmp / "failures"))
        env.update(env_extra or {})
        procs.append(launch([str(Path(__file__)), str(tmp / "spec.json")], env, ROOT))
    done = collect(procs, timeout_s - (time.monotonic() - t0))
    seconds = time.monotonic() - t0
    if expect_ok:
        for rank, d in enumerate(done):
            assert d is not None, f"rank {rank} did not finish within {timeout_s} s"
            assert d.returncode == 0, f"rank {rank} exited {d.returncode}:\n{d.stderr[-4000:]}"
    out = Path(spec["out"])
    return (json.loads(out.read_text()) if out.exists() else None), done, seconds


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker()
