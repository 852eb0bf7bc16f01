"""The tensor manager on real runs: the app trained with a device budget that forces swaps
against the same run all-resident, in the same invocation, alternating blocks.

    flock /tmp/pipenas-bench.lock .venv/bin/python bench/vtm_cpu.py [--rounds 3] [--setting conv]
    .venv/bin/python bench/vtm_cpu.py --device cuda     # on a machine with a GPU

Prints one JSON line per run (``"kind": "run"``) and one per setting (``"kind": "summary"``):
the median step time of each mode (from metrics.jsonl, steps after the first), the overhead of
the budget (median of the per-round ratios, order alternated each round; the machine is shared,
so the spread of those ratios is printed too), the host time spent inside the manager's calls
as a share of the run (a figure the machine's noise hardly moves), whether both modes
trained the same weights (``params_digest``), and the manager's figures: bytes fetched and
written back per step, hit rate and stall time per training step, evictions over the run
(training and search). The budget is the largest
subnet's footprint (the least the run accepts), so nearly every step evicts.

With ``--device cuda`` it also measures host-to-device and device-to-host bandwidth from
pinned and pageable memory, and reports ``torch.cuda.max_memory_allocated`` of each run
against the budget (the arena is exactly the budget; the rest is activations, gradients and
data).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS: dict[str, list[str]] = {
    # the README's default run (conv space on digits), shorter
    "conv": ["train.steps=200"],
    # a wider transformer over the digits' rows: copies big enough to matter on CPU
    "transformer": ["space=transformer", "space.layers=8", "space.width=128", "train.steps=80",
                    "train.optimizer.name=adamw", "train.optimizer.lr=3e-3"],
}
COMMON = ["search.population=4", "search.generations=1", "search.bn_calib_batches=1",
          "train.checkpoint_every=0", "threads=1"]


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def footprints(overrides: list[str], optimizer: str) -> tuple[int, int]:
    """(whole supernet, largest subnet) bytes in the arena, from the run's own config, with the
    optimizer state on the host or the device (``memory.optimizer``)."""
    import supernet.spaces  # noqa: F401
    from pipeline.memory import MemorySettings, TensorManager
    from search.config import build_data, build_space, load_config

    rc = load_config(compose(overrides))
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    tm = TensorManager(graph, rc.seed, rc.train.optimizer, rc.device if rc.device != "auto" else "cpu",
                       memory=MemorySettings(optimizer=optimizer))
    return tm.footprint(s.op_id for s in graph.slots()), tm.largest_subnet_footprint()


def one_run(overrides: list[str], device: str) -> dict[str, Any]:
    from search.app import run

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        summary = run(compose(overrides), output_dir=out)
        steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    res = {
        "train_time_s": summary["train_time_s"], "wall_time_s": summary["wall_time_s"],
        "step_s_median": statistics.median(s["seconds"] for s in steps[1:]),
        "params_digest": summary["params_digest"], "memory": summary["memory"],
        "stall_s_per_step": statistics.fmean(s["stall_s"] or 0.0 for s in steps),
        "hit_rate_train": statistics.fmean(s["hit_rate"] if s["hit_rate"] is not None else 1.0 for s in steps),
        "fetched_bytes_per_step": statistics.fmean(s["fetched_bytes"] or 0 for s in steps),
        "written_back_bytes_per_step": statistics.fmean(s["written_back_bytes"] or 0 for s in steps),
        "steps": len(steps),
        # host time inside the manager's calls (bookkeeping, issuing copies, stalls), whole run
        "manager_busy_pct": round(100 * (summary["memory"].get("busy_s") or 0.0) / summary["wall_time_s"], 3),
    }
    if device == "cuda":
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return res


def bandwidth(sizes_mib: tuple[int, ...] = (16, 256), repeat: int = 10) -> list[dict[str, Any]]:
    """Host <-> device copy bandwidth (GB/s) from pinned and pageable host memory."""
    rows = []
    for mib in sizes_mib:
        n = mib * 2**20
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for kind in ("pinned", "pageable"):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=(kind == "pinned"))
            for direction in ("h2d", "d2h"):
                dst, src = (dev, host) if direction == "h2d" else (host, dev)
                dst.copy_(src, non_blocking=True)  # warm-up
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeat):
                    dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                secs = start.elapsed_time(end) / 1e3 / repeat
                rows.append({"kind": "bandwidth", "size_mib": mib, "host_memory": kind, "direction": direction,
                             "gb_per_s": round(n / secs / 1e9, 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    from pipeline.memory.settings import CPU_COPIES, OPTIMIZER_PLACEMENTS, POLICIES, MemorySettings
    from search.samplers import ORDERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--setting", action="append", choices=sorted(SETTINGS), help="default: all")
    ap.add_argument("--policy", default="belady", choices=POLICIES)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="budget = scale x the largest subnet")
    ap.add_argument("--cpu-copies", default="inline", choices=CPU_COPIES,
                    help="memory.cpu_copies: copies on the calling thread (the default), or a background thread")
    ap.add_argument("--optimizer", default=MemorySettings().optimizer, choices=OPTIMIZER_PLACEMENTS,
                    help="memory.optimizer (default: the config's default): the state stays on the host and is "
                         "updated there, travels with its op (device), or per op and step (hybrid)")
    ap.add_argument("--sampler", default=None, choices=("uniform", "fair"), help="sampler.name (default: the config's)")
    ap.add_argument("--order", default="stream", choices=ORDERS,
                    help="sampler.order in both modes: as drawn, or locality-aware within each fair round / block")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device")
        for row in bandwidth():
            print(json.dumps(row), flush=True)
    for name in args.setting or sorted(SETTINGS):
        base = [*SETTINGS[name], *COMMON, f"device={args.device}", f"sampler.order={args.order}",
                *([f"sampler={args.sampler}"] if args.sampler else [])]
        supernet_bytes, largest = footprints(base, args.optimizer)
        budget = int(largest * args.budget_scale)
        modes = {"resident": base,
                 "budget": [*base, f"memory.device_budget_bytes={budget}", f"memory.policy={args.policy}",
                            f"memory.cpu_copies={args.cpu_copies}", f"memory.optimizer={args.optimizer}"]}
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                t0 = time.perf_counter()
                res = one_run(modes[mode], args.device)
                runs[mode].append(res)
                print(json.dumps({"kind": "run", "setting": name, "mode": mode, "round": r,
                                  "seconds": round(time.perf_counter() - t0, 2), **res}), flush=True)
        ratios = [b["step_s_median"] / a["step_s_median"] for a, b in zip(runs["resident"], runs["budget"])]
        train_ratios = [b["train_time_s"] / a["train_time_s"] for a, b in zip(runs["resident"], runs["budget"])]
        mem = runs["budget"][0]["memory"]
        out = {
            "kind": "summary", "setting": name, "device": args.device, "policy": args.policy,
            "optimizer": args.optimizer, "sampler": args.sampler or "config default", "order": args.order,
            "cpu_copies": args.cpu_copies if args.device == "cpu" else None,
            "supernet_bytes": supernet_bytes, "largest_subnet_bytes": largest, "budget_bytes": budget,
            "oversubscription": round(supernet_bytes / budget, 2), "rounds": args.rounds,
            "step_s_median_resident": statistics.median(x["step_s_median"] for x in runs["resident"]),
            "step_s_median_budget": statistics.median(x["step_s_median"] for x in runs["budget"]),
            "overhead_pct_step": round(100 * (statistics.median(ratios) - 1), 2),
            "overhead_pct_train": round(100 * (statistics.median(train_ratios) - 1), 2),
            "paired_step_ratios": [round(x, 4) for x in ratios],
            "paired_step_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
            "manager_busy_pct_median": statistics.median(x["manager_busy_pct"] for x in runs["budget"]),
            "same_digest": len({x["params_digest"] for rs in runs.values() for x in rs}) == 1,
            "fetched_bytes_per_step": round(runs["budget"][0]["fetched_bytes_per_step"]),
            "written_back_bytes_per_step": round(runs["budget"][0]["written_back_bytes_per_step"]),
            "evictions_run": mem["evictions"], "hit_rate_train": round(runs["budget"][0]["hit_rate_train"], 4),
            "stall_s_per_step": runs["budget"][0]["stall_s_per_step"],
            "resident_bytes_peak": mem["resident_bytes_peak"],
        }
        if args.device == "cuda":
            out["max_memory_allocated_resident"] = max(x["max_memory_allocated"] for x in runs["resident"])
            out["max_memory_allocated_budget"] = max(x["max_memory_allocated"] for x in runs["budget"])
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
