"""What PortableAdamW costs against torch's AdamW: one update of a subnet's op parameters.

PortableAdamW (``pipeline/memory/optim.py``) is the tensor manager's AdamW on CUDA: one rounding
per operation, so a host-side update gives the GPU's bits. It launches about 10 elementwise
kernels per parameter; torch's AdamW as ``OptimConfig`` builds it (``foreach=False`` until
2026-11-26, about 6 kernels; the fused kernel since, one call for all). This times
both, alternating, on the parameters of one subnet of the app's transformer (``--width``,
``--layers``) through ``OptimGroup`` (the engine's one call per stage), medians over
``--repeats``, and says whether one update of each gives the same bits as the other.

    .venv/bin/python bench/optim_step.py [--device cpu|cuda] [--repeats 50]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.split_backward import _graph, _sync  # noqa: E402
from pipeline.memory.optim import OptimConfig, OptimGroup  # noqa: E402
from supernet import build_op  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    graph, _ = _graph(["space=transformer", f"space.width={args.width}", f"space.layers={args.layers}"])
    active = graph.active_ops(graph.space().random(random.Random(0)))
    kinds = ["torch", "portable"] + (["fused", "foreach"] if args.device == "cuda" else [])
    runs = {}
    for kind in kinds:
        cfg = (OptimConfig(name="adamw", lr=1e-3, weight_decay=0.01, portable=kind == "portable")
               if kind in ("torch", "portable") else KernelAdamW(name="adamw", lr=1e-3, weight_decay=0.01, kernel=kind))
        torch.manual_seed(1)
        mods = {op.op_id: build_op(op.spec, op.op_id, 0).to(args.device) for op in active}
        mods = {k: m for k, m in mods.items() if any(True for _ in m.parameters())}
        opts = [(k, cfg.build(list(m.parameters()))) for k, m in mods.items()]
        runs[kind] = (mods, opts, OptimGroup(cfg, torch.device(args.device)))
    numel = sum(p.numel() for p in runs["torch"][0].values() for p in p.parameters())
    times: dict[str, list[float]] = {k: [] for k in kinds}
    gen = torch.Generator(device=args.device).manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen, device=args.device)
             for m in runs["torch"][0].values() for p in m.parameters()]
    for r in range(args.repeats + 3):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            mods, opts, group = runs[kind]
            for p, g in zip((p for m in mods.values() for p in m.parameters()), grads):
                p.grad = g.clone()
            _sync(args.device)
            t0 = time.perf_counter()
            group.step(opts, 1e-3)
            _sync(args.device)
            if r >= 3:
                times[kind].append(time.perf_counter() - t0)

    def same(a: str, b: str) -> bool:
        return all(torch.equal(x, y) for x, y in zip((p for m in runs[a][0].values() for p in m.parameters()),
                                                      (p for m in runs[b][0].values() for p in m.parameters())))

    ms = {k: statistics.median(times[k]) * 1e3 for k in kinds}
    row = {"bench": "optim_step", "device": args.device, "width": args.width, "layers": args.layers,
           "ops": len(active), "parameters": numel, "repeats": args.repeats,
           "torch_adamw_ms": round(ms["torch"], 3), "portable_adamw_ms": round(ms["portable"], 3),
           "portable_over_torch": round(ms["portable"] / ms["torch"], 3), "same_bits_after": same("torch", "portable")}
    if args.device == "cuda":  # torch's fused CUDA kernel and foreach=True beside them: faster, and which bits?
        row.update(fused_adamw_ms=round(ms["fused"], 3), foreach_adamw_ms=round(ms["foreach"], 3),
                   fused_same_as_torch=same("fused", "torch"), fused_same_as_portable=same("fused", "portable"),
                   foreach_same_as_torch=same("foreach", "torch"))
    print(json.dumps(row))


@dataclasses.dataclass(frozen=True)
class KernelAdamW(OptimConfig):
    """torch's AdamW with another kernel than the app builds on this device (``kernel``: fused or
    foreach); ``bench/cuda_bits.py`` compares its bits too."""
    kernel: str = "fused"

    def build(self, params):  # type: ignore[override]
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay, **{self.kernel: True})


if __name__ == "__main__":
    main()
