"""Issue 22, from the command line: every combination trains to the one-process run's weights.

For each layout (``torchrun`` P = 2, P = 3, and the (2, 2) mesh: ``--nproc_per_node=4
pipeline.stages=2``), each ``pipeline.window`` (1, 4), each ``pipeline.shared_ops`` (exact,
delayed, frozen) and without / with a tensor-manager budget below half of the supernet's op
state, one run of ``python -m search`` as a user types it (``search=none``: train only, the
``fair`` sampler, short), its ``params_digest`` beside the one-process run's with the same
settings (``python -m search``, no layout, no budget: a budget changes where state lives, not
the bits). The spaces rotate over the runs (conv, transformer, and resmlp, whose fixed
``transition`` op sits mid-graph and changes stage between subnets), so every layout sees every
space; ``--every-space`` runs every combination on every space. The budget of a (space, layout) is the larger of the least the memory pre-check accepts
(its error names it) and 45 % of the op state; a row says when the least is above half.

    .venv/bin/python bench/composition_table.py [--steps 8] [--spaces conv transformer resmlp] [--every-space]
        [--extra pipeline.schedule=zbh1]     # the same table with the backward split

One JSON line per run (``"kind": "run"``) and a last one with the counts (``"kind": "table"``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._spawn import python_path  # noqa: E402

PY = sys.executable
LAYOUTS = {"P=2": (2, None), "P=3": (3, None), "(2,2)": (4, 2)}
MODES = ("exact", "delayed", "frozen")


def base_args(space: str, steps: int) -> list[str]:
    return [f"space={space}", "search=none", "sampler=fair", f"train.steps={steps}", "train.warmup_steps=2",
            "train.checkpoint_every=0", "train.monitor_every=0", "threads=1"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}


def digest_of(run_dir: Path) -> str | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()).get("params_digest") if path.exists() else None


def run(cmd: list[str], run_dir: Path) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    p = subprocess.run([*cmd, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=600)
    tail = (p.stderr.strip().splitlines() or [""])[-1]
    return p.returncode, time.perf_counter() - t0, tail


def op_state_bytes(space: str, extra: Sequence[str] = ()) -> int:
    """The supernet's op state (weights, buffers, optimizer state) under the app's settings
    (``extra``: more overrides, e.g. the space's options and the data's shape)."""
    from hydra import compose, initialize_config_dir

    from pipeline.memory import TensorManager
    from search.config import build_data, build_space, load_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        rc = load_config(compose("config", overrides=[f"space={space}", *extra]))
    data = build_data(rc.data)
    graph = build_space(rc.space, data.input_shape, data.num_classes)
    tm = TensorManager(graph, rc.seed, rc.train.optimizer)
    return tm.footprint(slot.op_id for slot in graph.slots())


def least_budget(space: str, world: int, stages: int | None, steps: int, tmp: Path, extra: Sequence[str] = ()) -> int:
    """The least device budget the pre-check accepts for this layout (from its one-line error);
    ``extra``: more overrides (the run directory is named by them: calls may run at once)."""
    layout = [f"pipeline.stages={stages}"] if stages else []
    name = re.sub(r"[^A-Za-z0-9]+", "_", "-".join(["precheck", *extra]))
    p = subprocess.run([PY, "-m", "search", *base_args(space, steps), *layout, *extra, "memory.device_budget_bytes=1",
                        f"hydra.run.dir={tmp / name}"], cwd=ROOT, capture_output=True, text=True,
                       env={**env(), "RANK": "0", "WORLD_SIZE": str(world)}, timeout=300)
    found = re.search(r"at least (\d+)", p.stderr)
    if found is None:
        raise RuntimeError(f"{space} {world}: no least budget in the pre-check's error: {p.stderr[-500:]}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--spaces", nargs="+", default=["conv", "transformer", "resmlp"])
    ap.add_argument("--extra", nargs="*", default=[], metavar="OVERRIDE",
                    help="overrides for every run, one process and torchrun alike (e.g. pipeline.schedule=zbh1)")
    ap.add_argument("--every-space", action="store_true",
                    help="run every combination on every space (3x the runs) instead of rotating the spaces")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-composition-"))
    ref: dict[tuple, str | None] = {}
    whole = {sp: op_state_bytes(sp) for sp in args.spaces}
    counts = {"runs": 0, "equal": 0, "failed": 0}
    leasts: dict[tuple[str, str], int] = {}  # (space, layout) -> the pre-check's least budget
    combos = list(itertools.product(LAYOUTS, (1, 4), MODES, (False, True)))
    if args.every_space:
        cells = [(c, sp) for c in combos for sp in args.spaces]
    else:  # rotate: every layout still sees every space
        cells = [(c, args.spaces[(i + list(LAYOUTS).index(c[0])) % len(args.spaces)]) for i, c in enumerate(combos)]
    for (layout, window, mode, budgeted), space in cells:
        world, stages = LAYOUTS[layout]
        settings = [f"pipeline.window={window}", f"pipeline.shared_ops={mode}", *args.extra]
        key = (space, window, mode)
        if key not in ref:
            code, secs, tail = run([PY, "-m", "search", *base_args(space, args.steps), *settings],
                                   tmp / f"one-{space}-{window}-{mode}")
            ref[key] = digest_of(tmp / f"one-{space}-{window}-{mode}") if code == 0 else None
            print(json.dumps({"kind": "one_process", "space": space, "window": window, "shared_ops": mode,
                              "digest": ref[key], "seconds": round(secs, 1), **({"error": tail} if code else {})}),
                  flush=True)
        extra = [f"pipeline.stages={stages}"] if stages else []
        row = {"kind": "run", "layout": layout, "space": space, "window": window, "shared_ops": mode}
        if budgeted:
            if (space, layout) not in leasts:
                leasts[(space, layout)] = least_budget(space, world, stages, args.steps, tmp)
            least = leasts[(space, layout)]
            budget = max(least, int(0.45 * whole[space]))
            extra.append(f"memory.device_budget_bytes={budget}")
            row.update(budget=budget, half_op_state=whole[space] // 2, below_half=budget < whole[space] / 2)
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{layout}-{space}-{window}-{mode}-{int(budgeted)}")  # a Hydra-safe dir name
        code, secs, tail = run([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "-m", "search",
                                *base_args(space, args.steps), *settings, *extra], tmp / name)
        got = digest_of(tmp / name) if code == 0 else None
        row.update(digest=got, one_process=ref[key], equal=got is not None and got == ref[key],
                   seconds=round(secs, 1), **({"error": tail} if code else {}))
        counts["runs"] += 1
        counts["equal"] += row["equal"]
        counts["failed"] += code != 0
        print(json.dumps(row), flush=True)
    print(json.dumps({"kind": "table", **counts, "steps": args.steps, "extra": args.extra}), flush=True)


if __name__ == "__main__":
    main()
