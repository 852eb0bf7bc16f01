"""Issue 22 on one GPU: every combination under a budget trains to the all-resident weights.

``bench/composition_table.py`` proves the combinations bit-identical across processes on the
CPU. On CUDA the tensor manager runs other code (the copier's streams and events, pinned host
homes, PortableAdamW for host-side updates), and a GPU rounds differently from a CPU, so this
runs, in one process on the job's GPU (``python -m search device=cuda``, as a user types it), each
space (conv, transformer with its AdamW preset, resmlp with its mid-graph fixed op), each
``pipeline.window`` (1, 4) and ``pipeline.shared_ops`` (exact, delayed, frozen) twice: all-resident,
and under a budget of 45 % of the supernet's op state (or the least the pre-check accepts, if
more). It also runs, under the budget at window 4 delayed, each other optimizer placement and
activation mode. A run's ``params_digest`` must equal the all-resident run's of the same settings.

    python bench/cuda_compose.py [--device cuda] [--jobs 6] [--steps 8] [--variants memory.activations=swap]

One JSON line per budgeted run (``"kind": "run"``) and a last one with the counts. ``--device
cpu`` runs the same table on the CPU (what the test suite proves already; a check of this script).
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.composition_table import PY, base_args, digest_of, least_budget, op_state_bytes, run  # noqa: E402

MODES = ("exact", "delayed", "frozen")
VARIANTS = (("memory.optimizer=device",), ("memory.optimizer=host",), ("memory.activations=swap",),
            ("memory.activations=recompute",), ("memory.policy=lru",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--spaces", nargs="+", default=["conv", "transformer", "resmlp"])
    ap.add_argument("--variants", nargs="*", default=None, metavar="OVERRIDE",
                    help="only these of the window-4 delayed rows (e.g. memory.activations=swap; several overrides "
                         "in one quoted argument make one row), no base grid")
    args = ap.parse_args()
    variants = VARIANTS if args.variants is None else tuple(tuple(v.split()) for v in args.variants)
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-cuda-compose-"))
    common = [f"device={args.device}"]
    with ThreadPoolExecutor(args.jobs) as pool:
        whole = {sp: op_state_bytes(sp) for sp in args.spaces}
        keys = list(itertools.product(args.spaces, ((), *variants)))
        leasts = dict(zip(keys, pool.map(lambda k: least_budget(k[0], 1, None, args.steps, tmp, [*common, *k[1]]),
                                         keys)))
        budget = {k: max(least, int(0.45 * whole[k[0]])) for k, least in leasts.items()}
        cells = [(sp, w, m, ()) for sp, w, m in itertools.product(args.spaces, (1, 4), MODES)
                 if args.variants is None]
        cells += [(sp, 4, "delayed", v) for sp in args.spaces for v in variants]

        def one(cell: tuple, budgeted: bool) -> tuple[str | None, float, str, int]:
            sp, w, m, variant = cell
            extra = [*([f"memory.device_budget_bytes={budget[sp, variant]}"] if budgeted else []), *variant]
            name = re.sub(r"[^A-Za-z0-9]+", "_", f"{sp}-{w}-{m}-{'-'.join(variant)}-{int(budgeted)}")
            code, secs, tail = run([PY, "-m", "search", *base_args(sp, args.steps), *common, f"pipeline.window={w}",
                                    f"pipeline.shared_ops={m}", *extra], tmp / name)
            return (digest_of(tmp / name) if code == 0 else None), secs, tail, code

        def twin(cell: tuple) -> tuple:
            """The cell less its memory settings: what its all-resident twin runs (a clipped row's twin clips)."""
            sp, w, m, variant = cell
            return sp, w, m, tuple(o for o in variant if not o.startswith("memory."))

        refs = {key: pool.submit(one, key, False) for key in {twin(c) for c in cells}}
        runs = [(c, pool.submit(one, c, True)) for c in cells]
        counts = {"runs": 0, "equal": 0, "failed": 0}
        for cell, fut in runs:
            sp, w, m, variant = cell
            got, secs, tail, code = fut.result()
            ref, _, ref_tail, ref_code = refs[twin(cell)].result()
            row = {"kind": "run", "device": args.device, "space": sp, "window": w, "shared_ops": m,
                   "variant": " ".join(variant), "budget": budget[sp, variant], "op_state": whole[sp],
                   "below_half": budget[sp, variant] < whole[sp] / 2, "digest": got, "all_resident": ref,
                   "equal": got is not None and got == ref, "seconds": round(secs, 1)}
            if code:
                row["error"] = tail
            if ref_code:
                row["all_resident_error"] = ref_tail
            counts["runs"] += 1
            counts["equal"] += row["equal"]
            counts["failed"] += code != 0
            print(json.dumps(row), flush=True)
    print(json.dumps({"kind": "table", "device": args.device, **counts, "steps": args.steps}), flush=True)


if __name__ == "__main__":
    main()
