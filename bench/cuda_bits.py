"""Where a CUDA run's bits come from: the tensor manager against all-resident on the GPU.

On the CPU every test proves the manager bit-identical to all-resident. On CUDA two things can
break that, and this measures each apart, in one run, on the job's GPU:

* ``repeat``: the same all-resident run twice, with torch's default kernels and with its
  deterministic ones (``pipeline/determinism.py``, the config's ``deterministic``): do two runs
  of one config give the same bits at all?
* ``budget``: a budget that forces evictions, each optimizer placement (``device``: the update on
  the GPU; ``host``/``hybrid``: some updates on the CPU), against all-resident, deterministic kernels;
* ``elementwise``: each operation an update is made of, CPU against GPU (an H200: the float
  ``sqrt`` and a division by a scalar differ; in float64 the square root does not);
* ``update``: one optimizer step (SGD with momentum, torch's AdamW, :class:`PortableAdamW`) of
  the same tensors on the CPU and on the GPU: the same bits or not (torch's AdamW kernels fuse
  multiply-adds, which the CPU and the GPU round differently; the tensor manager runs
  PortableAdamW on CUDA, so the ``budget`` rows use it).

One JSON line per comparison: ``same`` (losses and final weights' digest equal) and the largest
relative loss difference. Needs CUDA.

    python bench/cuda_bits.py [--space conv] [--steps 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.optim_step import KernelAdamW  # noqa: E402
from distributed import arch_stream, build_graph, step_data  # noqa: E402
from pipeline import LrSchedule, MemorySettings, OptimConfig, ReferenceEngine, params_digest  # noqa: E402
from pipeline.determinism import use_deterministic_kernels  # noqa: E402
from pipeline.memory import TensorManager  # noqa: E402

DEV = "cuda"
OPTIMS = {"sgd": OptimConfig("sgd", lr=0.05, momentum=0.9, weight_decay=1e-4),
          "adamw": OptimConfig("adamw", lr=3e-3, weight_decay=0.01)}


def train(space: str, optim: str, steps: int, memory: MemorySettings | None) -> tuple[list[float], str]:
    graph = build_graph(space)
    ReferenceEngine._check_budget = lambda self: None  # the tightest budget of this run's own subnets
    e = ReferenceEngine(graph, 0, OPTIMS[optim], 4, LrSchedule(OPTIMS[optim].lr, steps), DEV, memory=memory)
    archs = arch_stream(graph, 0, steps + 1)
    losses = []
    for s in range(steps):
        e.plan_ahead(archs[s + 1 : s + 3])
        losses.append(e.train_step(s, archs[s], *step_data(0, s, 16)).loss)
    digest = params_digest(e.op_states())
    e.close()
    return losses, digest


def tight(space: str, optim: str, steps: int, placement: str) -> int:
    graph = build_graph(space)
    tm = TensorManager(graph, 0, OPTIMS[optim], DEV, memory=MemorySettings(optimizer=placement))  # the device's alignment
    return max(tm.footprint(op.op_id for op in graph.active_ops(a)) for a in arch_stream(graph, 0, steps + 1))


def compare(what: str, a: tuple[list[float], str], b: tuple[list[float], str], **info) -> None:
    rel = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a[0], b[0]))
    print(json.dumps({"bench": "cuda_bits", "what": what, **info, "same": a == b, "max_rel_loss_diff": rel}),
          flush=True)


def update_bits(optim: str, portable: bool = False, kernel: str | None = None) -> bool:
    """One update of the same tensors on the CPU and the GPU: the same bits? ``kernel``: torch's
    AdamW with ``fused=True`` or ``foreach=True`` on both (None: as ``OptimConfig`` builds it)."""
    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(4096, generator=g), [torch.randn(4096, generator=g) for _ in range(3)]
    outs = []
    for dev in ("cpu", "cuda"):
        p = torch.nn.Parameter(p0.clone().to(dev))
        c = dataclasses.replace(OPTIMS[optim], portable=portable)
        opt = (c if kernel is None else KernelAdamW(**dataclasses.asdict(c), kernel=kernel)).build([p])
        for gr in grads:
            p.grad = gr.to(dev)
            opt.step()
        outs.append(p.detach().cpu())
    return torch.equal(outs[0], outs[1])


ELEMENTWISE = {  # the operations an optimizer update is made of, each one kernel
    "mul_scalar": lambda x, y: x * 0.1, "add_scalar": lambda x, y: x + 1e-8, "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
    "div_scalar": lambda x, y: x / 0.7, "mul_reciprocal": lambda x, y: x * (1 / 0.7),
    "sqrt": lambda x, y: y.sqrt(), "sqrt_in_float64": lambda x, y: y.double().sqrt().float(),
}


def elementwise_bits() -> list[dict]:
    """Per operation, how many of 65,536 float32 results differ between the CPU and the GPU."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1 << 16, generator=g), torch.randn(1 << 16, generator=g).abs() + 0.1
    rows = []
    for name, f in ELEMENTWISE.items():
        c, d = f(a, b), f(a.cuda(), b.cuda()).cpu()
        rows.append({"bench": "cuda_bits", "what": "elementwise", "op": name, "same": torch.equal(c, d),
                     "differing": int((c != d).sum()), "of": c.numel()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--space", default="conv")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--updates-only", action="store_true", help="the elementwise and update rows only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_bits.py: needs CUDA")
    for row in elementwise_bits():
        print(json.dumps(row), flush=True)
    for optim, portable in (("sgd", False), ("adamw", False), ("adamw", True)):
        print(json.dumps({"bench": "cuda_bits", "what": "update", "optim": optim, "portable": portable,
                          "same": update_bits(optim, portable)}), flush=True)
    for kernel in ("fused", "foreach"):  # could the CPU's fused kernel give a CUDA run's bits?
        print(json.dumps({"bench": "cuda_bits", "what": "update", "optim": "adamw", "kernel": kernel,
                          "same": update_bits("adamw", kernel=kernel)}), flush=True)
    if args.updates_only:
        return
    for optim in OPTIMS:
        for det in (False, True):
            use_deterministic_kernels("cuda", det)
            compare("repeat", train(args.space, optim, args.steps, None), train(args.space, optim, args.steps, None),
                    optim=optim, deterministic=det, space=args.space)
        use_deterministic_kernels("cuda", True)
        ref = train(args.space, optim, args.steps, None)
        for placement in ("device", "host", "hybrid"):
            mem = MemorySettings(device_budget_bytes=tight(args.space, optim, args.steps, placement), optimizer=placement)
            compare("budget", ref, train(args.space, optim, args.steps, mem), optim=optim, optimizer=placement,
                    deterministic=True, space=args.space)


if __name__ == "__main__":
    main()
