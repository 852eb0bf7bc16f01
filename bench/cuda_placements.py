"""Issue 22 on one GPU: what the tensor manager costs a real cross-subnet run, by optimizer placement.

``bench/vtm_cross.py`` simulates the tensor manager under cross-subnet schedules (NASPipe's space,
P = 4); ``bench/cuda_compose.py`` proves the placements give the all-resident bits on a GPU. This
times them: one process (``python -m search device=cuda``, as a user types it), NASPipe's
24-candidate transformer space cut to ``--layers`` x ``--width``, synthetic inputs of ``--tokens``
tokens, the fair sampler, ``pipeline.window=4`` with delayed shared ops, AdamW (the space's preset).
Each budget is a fraction of the supernet's op state (``--over 4``: a quarter of it, 4x
over-subscription); each round runs all-resident and then every placement under every budget, the
order of the placements turned each round. Per run: train time, the median step time (steps past
the first quarter), the manager's figures, and whether the weights equal the all-resident run's.

    python bench/cuda_placements.py [--device cuda] [--layers 8] [--width 512] [--tokens 64] \\
        [--batch 256] [--steps 40] [--over 4 8] [--placements device hybrid host] [--rounds 2]

One JSON line per run (``"kind": "run"``) and one per budget and placement (``"kind": "summary"``:
medians, the ratio to all-resident's median step time). ``--device cpu --layers 2 --width 32``
checks the script on a CPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.composition_table import env, op_state_bytes  # noqa: E402


def space_args(a: argparse.Namespace) -> list[str]:
    return ["space=transformer", "space.preset=naspipe", f"space.layers={a.layers}", f"space.width={a.width}",
            "data=synthetic", f"data.input_shape=[1,{a.tokens},{a.tokens}]", f"data.size={4 * a.batch}",
            f"train.batch_size={a.batch}", "search=none", "sampler=fair", f"train.steps={a.steps}",
            "train.warmup_steps=2", "train.checkpoint_every=0", "train.monitor_every=0", "train.tensorboard=false",
            "pipeline.window=4", "pipeline.shared_ops=delayed", f"device={a.device}"]


def one_run(cmd: list[str], run_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "search", *cmd, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=900)
    try:
        if p.returncode != 0:
            return {"failed": (p.stderr.strip().splitlines() or ["?"])[-1][-400:]}
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = [json.loads(ln)["seconds"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    finally:  # a run's checkpoint is the whole supernet (4 GB at width 1024): 14 runs filled a 64 GB disk
        shutil.rmtree(run_dir, ignore_errors=True)
    mem = summary.get("memory") or {}
    return {"train_time_s": summary["train_time_s"], "wall_s": round(time.perf_counter() - t0, 1),
            "step_s": statistics.median(steps[len(steps) // 4:]), "steps_s": [round(x, 4) for x in steps],
            "params_digest": summary["params_digest"],
            **{k: mem.get(k) for k in ("hit_rate", "stall_s", "fetched_bytes", "written_back_bytes",
                                       "resident_bytes_peak", "late", "misses")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--over", type=float, nargs="+", default=[4.0, 8.0], help="over-subscriptions (budget = state / over)")
    ap.add_argument("--placements", nargs="+", default=["device", "hybrid", "host"],
                    help="memory.optimizer values, each optionally with more overrides in the same quoted argument "
                         "(e.g. 'hybrid memory.host_update_threads=0')")
    ap.add_argument("--extra", nargs="*", default=[], metavar="OVERRIDE", help="overrides for every run")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    base = [*space_args(a), *a.extra]
    state = op_state_bytes("transformer", [o for o in base if not o.startswith(("space=", "device="))])
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-cuda-placements-"))
    cells = [(over, pl) for over in a.over for pl in a.placements]
    runs: dict[tuple, list[dict]] = {}
    serial = itertools.count()
    for r in range(a.rounds):
        order = [("resident", None), *(cells if r % 2 == 0 else cells[::-1])]
        for over, pl in order:
            name, *more = (pl or "resident").split()
            cmd = list(base) if pl is None else [*base, f"memory.device_budget_bytes={int(state / over)}",
                                                 f"memory.optimizer={name}", *more]
            res = one_run(cmd, tmp / f"run{next(serial)}")
            key = ("resident", None) if pl is None else (pl, over)
            runs.setdefault(key, []).append(res)
            print(json.dumps({"kind": "run", "round": r, "placement": key[0], "over": key[1], "op_state_bytes": state,
                              **res}), flush=True)
    ref = runs[("resident", None)]
    ref_step = statistics.median(x["step_s"] for x in ref if "step_s" in x)
    ref_digest = {x.get("params_digest") for x in ref}
    for key, rs in runs.items():
        ok = [x for x in rs if "step_s" in x]
        if not ok:
            continue
        step = statistics.median(x["step_s"] for x in ok)
        print(json.dumps({"kind": "summary", "placement": key[0], "over": key[1], "runs": len(ok),
                          "step_s": round(step, 5), "train_time_s": statistics.median(x["train_time_s"] for x in ok),
                          "over_resident": round(ref_step / step, 3), "hit_rate": ok[-1].get("hit_rate"),
                          "stall_s": ok[-1].get("stall_s"),
                          "same_bits": all(x["params_digest"] in ref_digest for x in ok) and len(ref_digest) == 1}),
              flush=True)


if __name__ == "__main__":
    main()
