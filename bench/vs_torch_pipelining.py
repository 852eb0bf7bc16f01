"""Issue 8: our pipelined step against torch.distributed.pipelining on one fixed subnet and cut.

The work: the transformer space (8 layers, candidates attn2, ffn2, conv3, identity) at width 64
and 256, one fixed subnet (``space.random(random.Random(seed))``), batches of 32 samples of
32 tokens x 32 features, SGD (momentum 0.9, weight decay 1e-4), 2 gloo ranks on CPU with one
intra-op thread each. Per setting (width x schedule in {gpipe, 1f1b} x M in {4, 8}):

* **ours**: ``PipelineEngine`` (planner ``dynamic``); its first step fixes the cut (the subnet
  never changes, so nothing migrates afterwards);
* **torch**: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` over modules holding the
  same ops with the same initial weights, cut at the same place, ``loss_fn`` the same summed
  cross-entropy over the batch size (``scale_grads=False``), one ``torch.optim.SGD`` per stage.

Both run in the same processes in alternating blocks of steps (order flipped every block, so
drift of this shared VM's speed hits both alike). A step starts at a barrier; its time is the
slowest rank's wall time (the optimizer step included on both sides); median over the measured
steps. One JSON line per setting with both medians and the ratio ours / torch.

    python bench/vs_torch_pipelining.py [--widths 64 256] [--steps 24] [--block 4]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import emit, progress, spawn  # noqa: E402

SAMPLE = (32, 32)
BATCH = 32
CANDIDATES = ["attn2", "ffn2", "conv3", "identity"]


def _graph(width: int):
    from supernet.spaces import build_space

    return build_space("transformer", input_shape=SAMPLE, num_classes=10, layers=8, width=width,
                       candidates=CANDIDATES)


class _TorchStage(torch.nn.Module):
    """One stage's ops as a plain module for torch's PipelineStage: the slice's inputs in, its
    outputs out, each op with the weights our engine starts from (same seed, same op id)."""

    def __init__(self, sl, seed: int) -> None:
        from supernet import build_op

        super().__init__()
        self.slice = sl
        self.ops = torch.nn.ModuleList(build_op(op.spec, op.op_id, seed) for op in sl.ops)
        self.seed = seed

    def forward(self, *inputs):
        from supernet import OpContext
        from supernet.ops import run_op

        env = dict(zip(self.slice.inputs, inputs))
        for op, module in zip(self.slice.ops, self.ops):
            env[op.node] = run_op(module, [env[s] for s in op.inputs], OpContext(self.seed, 0, 0, op.op_id, True))
        outs = tuple(env[n] for n in self.slice.outputs)
        return outs[0] if len(outs) == 1 else outs


def worker(spec: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from pipeline import DistEnv, LrSchedule, OptimConfig, PipelineSettings
    from pipeline.runtime import PipelineEngine
    from supernet import classification_loss

    g = torch.Generator().manual_seed(spec["seed"])
    x, y = torch.randn(BATCH, *SAMPLE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    optim = OptimConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
    lr = LrSchedule(optim.lr, 100000)
    out = []
    for width, schedule, M in spec["settings"]:
        graph = _graph(width)
        arch = graph.space().random(random.Random(spec["seed"]))
        settings = PipelineSettings(schedule=schedule, planner="dynamic", timeout_s=120.0)
        ours = PipelineEngine(graph, spec["seed"], optim, M, lr, settings, DistEnv(rank, world, rank),
                              torch.device("cpu"))
        ours.plan_ahead([arch, arch])  # as the app does: the sampler's lookahead
        ours.train_step(0, arch, x, y)  # fixes the cut; the subnet never changes after this
        bounds = ours.stats.bounds
        sl = ours.plan(arch).slices[rank]
        module = _TorchStage(sl, spec["seed"])
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stage, M, loss_fn=lambda out, tgt: classification_loss(out, tgt, BATCH), scale_grads=False)
        opt = torch.optim.SGD(module.parameters(), lr=optim.lr, momentum=optim.momentum,
                              weight_decay=optim.weight_decay)
        step_no = [1]

        def run_torch() -> None:
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y)
            else:
                sched.step()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def run_ours() -> None:
            ours.plan_ahead([arch, arch])
            ours.train_step(step_no[0], arch, x, y)
            step_no[0] += 1

        sides = {"torch": run_torch, "ours": run_ours}
        for fn in sides.values():  # warm-up (torch infers shapes on its first step)
            for _ in range(2):
                dist.barrier()
                fn()
        walls: dict[str, list[float]] = {k: [] for k in sides}
        order = list(sides)
        for block in range(spec["steps"] // spec["block"]):
            for name in (order if block % 2 == 0 else order[::-1]):
                for _ in range(spec["block"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    sides[name]()
                    walls[name].append(time.perf_counter() - t0)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, walls)
        if rank == 0:
            step = {k: [max(r[k][i] for r in gathered) for i in range(len(walls[k]))] for k in walls}
            out.append({"width": width, "schedule": schedule, "M": M, "bounds": list(bounds), "steps": step})
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--steps", type=int, default=24, help="measured steps per side and setting")
    ap.add_argument("--block", type=int, default=4, help="steps per block; sides alternate by block")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    settings = [(w, s, M) for w in args.widths for s in args.schedules for M in args.microbatches]
    spec = {"seed": args.seed, "steps": args.steps, "block": args.block, "settings": settings, "threads": 1,
            "timeout_s": 900}
    progress(f"2 gloo ranks, {len(settings)} settings x {args.steps} steps per side ...")
    t0 = time.perf_counter()
    res = spawn(2, "bench.vs_torch_pipelining:worker", spec, timeout_s=3000)
    progress(f"done in {time.perf_counter() - t0:.1f} s")
    rows = []
    for r in res:
        ours, theirs = statistics.median(r["steps"]["ours"]), statistics.median(r["steps"]["torch"])
        rows.append({
            "bench": "vs_torch_pipelining", "P": 2, "width": r["width"], "schedule": r["schedule"], "M": r["M"],
            "batch": BATCH, "bounds": r["bounds"], "steps_measured": len(r["steps"]["ours"]),
            "ours_step_ms": 1e3 * ours, "torch_step_ms": 1e3 * theirs, "ours_over_torch": ours / theirs,
            "ours_step_ms_iqr": [1e3 * q for q in statistics.quantiles(r["steps"]["ours"], n=4)[::2]],
            "torch_step_ms_iqr": [1e3 * q for q in statistics.quantiles(r["steps"]["torch"], n=4)[::2]],
            "cores": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "baseline": "torch.distributed.pipelining PipelineStage + ScheduleGPipe/Schedule1F1B, same ops, "
                        "weights and cut, same processes, alternating blocks",
        })
    emit("vs_torch_pipelining", rows)


if __name__ == "__main__":
    main()
