"""Issue 24: what serving batches through a torch ``DataLoader`` (search/torch_data.py) does to
the training step, against ``ArrayDataset`` on the same samples, in the same run.

One process, one intra-op thread, ``python -m search``'s default space and training (batch 64, 4
micro-batches) with ``search=none``, ``--steps`` steps per run. Two data sets, three sources each,
the same batches in every source (each data set's runs end with one ``params_digest``):

* **digits**: ``search.data.Digits`` (ArrayDataset, the baseline) against ``TorchData`` over the
  same tensors (``search.torch_data.digits``) with ``workers`` 0 and 2: the loader's own cost;
* **folder**: the digits as 8x8 PNGs on disk (``data=image_folder``, one channel): an
  ``ArrayDataset`` of the decoded images (the baseline) against reading each image with Pillow
  per step, ``workers`` 0 and 2: decoding in the step or beside it.

Runs go in rounds (every source once per round, the order rotated) and each source's figures are
medians over its runs' steps: ``step_ms`` is the time from one step's ``train_batch`` call to the
next (the whole step: data, compute, metrics), ``data_ms`` the time spent inside ``train_batch``
(waiting for the batch). One JSON line per data set, with each source's ratio to its baseline.

    python bench/data_loader.py [--steps 60] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._spawn import emit, progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOADER = ["~data", "+data._target_=search.torch_data.TorchData", "+data.seed=${seed}",
          "+data.train={_target_: search.torch_data.digits, split: train}",
          "+data.val={_target_: search.torch_data.digits, split: val}"]


class Timed:
    """A data source whose ``train_batch`` calls are timed: (called, returned) per call."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train_batch(self, step: int, batch_size: int) -> Any:
        t0 = time.perf_counter()
        batch = self.inner.train_batch(step, batch_size)
        self.calls.append((t0, time.perf_counter()))
        return batch


def folder_arrays(root: Path, seed: int) -> Any:
    """The image folder decoded once into an ArrayDataset (the same tensors, the same batches)."""
    from search.data import ArrayDataset
    from search.torch_data import ImageFolder

    train = ImageFolder(root / "train", channels=1)
    val = ImageFolder(root / "val", classes=train.classes, channels=1)
    stack = lambda ds: (torch.stack([ds[i][0] for i in range(len(ds))]),  # noqa: E731
                        torch.tensor([label for _, label in ds.samples]))
    return ArrayDataset(*stack(train), *stack(val), num_classes=len(train.classes), seed=seed)


def one_run(overrides: list[str], out: Path, swap: Any = None) -> tuple[list[float], list[float], str]:
    from hydra import compose, initialize_config_dir

    from search.app import prepare, run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    p = prepare(cfg, out)
    timed = Timed(swap if swap is not None else p.data)
    summary = run(cfg, out, prepared=dataclasses.replace(p, data=timed))
    calls = timed.calls[3:]  # the first steps warm up (and start the workers)
    steps = [(b[0] - a[0]) * 1e3 for a, b in zip(calls, calls[1:])]
    return steps, [(t1 - t0) * 1e3 for t0, t1 in calls], summary["params_digest"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from search.torch_data import write_digits

    tmp = Path(tempfile.mkdtemp(prefix="pipenas-bench-data-"))
    images = write_digits(tmp / "images", "image_folder")
    base = [f"train.steps={args.steps}", "train.checkpoint_every=0", f"train.log_every={args.steps}", "search=none",
            "threads=1", "seed=0"]
    folder = ["data=image_folder", f"data.root={images}", "data.channels=1"]
    sets = {
        "digits": {"array": (base, None), "torch_w0": ([*base, *LOADER, "+data.workers=0"], None),
                   "torch_w2": ([*base, *LOADER, "+data.workers=2"], None)},
        "folder": {"array": ([*base, *folder, "data.workers=0"], folder_arrays(images, 0)),
                   "torch_w0": ([*base, *folder, "data.workers=0"], None),
                   "torch_w2": ([*base, *folder, "data.workers=2"], None)},
    }
    rows = []
    for name, sources in sets.items():
        got: dict[str, dict[str, list]] = {s: {"step": [], "data": [], "digest": []} for s in sources}
        order = list(sources)
        for r in range(args.rounds):
            for s in order[r % len(order):] + order[:r % len(order)]:
                overrides, swap = sources[s]
                steps, data, digest = one_run(overrides, tmp / f"{name}-{s}-{r}", swap)
                got[s]["step"] += steps
                got[s]["data"] += data
                got[s]["digest"].append(digest)
                progress(f"{name} {s} round {r}: step {statistics.median(steps):.2f} ms, "
                         f"data {statistics.median(data):.3f} ms")
        med = {s: {"step_ms": statistics.median(v["step"]), "data_ms": statistics.median(v["data"])}
               for s, v in got.items()}
        for s in med:
            med[s]["step_over_array"] = med[s]["step_ms"] / med["array"]["step_ms"]
        rows.append({"bench": "data_loader", "data": name, "steps": args.steps, "rounds": args.rounds, "batch": 64,
                     "microbatches": 4, **med,
                     "same_params_digest": len({d for v in got.values() for d in v["digest"]}) == 1,
                     "baseline": "array: ArrayDataset of the same samples, same run", "loadavg": os.getloadavg()[0]})
    emit("data_loader", rows)


if __name__ == "__main__":
    main()
