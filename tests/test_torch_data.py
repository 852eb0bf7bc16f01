"""Torch datasets as a data source (search/torch_data.py): batches a pure function of (seed, step)
for any worker count and equal to ArrayDataset's, per-sample seeded augmentation, the two on-disk
formats on data written here, the digits' params_digest, the presets from the command line (one
process and torchrun) and their one-line errors."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from search.app import run
from search.config import ConfigError
from search.data import ArrayDataset
from search.torch_data import Cifar10, ImageFolder, TensorSet, TorchData
from tests.cli_driver import Case, run_cases, torchrun_search
from tests.test_app import TINY_CONV, make_cfg

CLASSES = ("cat", "dog", "emu")
SHORT = [*TINY_CONV, "train.steps=4", "train.batch_size=16", "train.microbatches=2", "train.warmup_steps=0",
         "train.log_every=2", "search.population=2", "search.generations=1", "search.top_k=1",
         "search.bn_calib_batches=1", "search.calib_batch_size=8", "search.val_batch_size=8", "threads=1"]
DIGITS_LOADER = ["~data", "+data._target_=search.torch_data.TorchData", "+data.seed=${seed}",
                 "+data.train={_target_: search.torch_data.digits, split: train}",
                 "+data.val={_target_: search.torch_data.digits, split: val}"]


def write_images(root: Path, per_class: dict[str, int], seed: int) -> None:
    """8x8 RGB PNGs, ``root/<class>/<i>.png``: noise around a colour per class (learnable)."""
    rng = np.random.default_rng(seed)
    for c, (name, n) in enumerate(per_class.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):
            base = np.array([80 * c, 255 - 80 * c, 40 + 60 * c])
            px = np.clip(base + rng.integers(-40, 40, (8, 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(px).save(root / name / f"{i}.png")


def write_cifar(root: Path, seed: int) -> None:
    """CIFAR-10's format, tiny: three data batches of 12 rows, a test batch of 12, the meta file."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "test_batch"):
        labels = rng.integers(0, 10, 12)
        data = np.clip(labels[:, None] * 25 + rng.integers(0, 30, (12, 3072)), 0, 255).astype(np.uint8)
        with (root / name).open("wb") as f:
            pickle.dump({b"data": data, b"labels": labels.tolist()}, f)
    with (root / "batches.meta").open("wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``images/{train,val}/<class>/*.png`` (36 + 12 images) and ``cifar/`` (36 + 12 rows)."""
    root = tmp_path_factory.mktemp("disk")
    write_images(root / "images" / "train", dict.fromkeys(CLASSES, 12), seed=1)
    write_images(root / "images" / "val", dict.fromkeys(CLASSES, 4), seed=2)
    write_cifar(root / "cifar", seed=3)
    return root


def equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return a[0].dtype == b[0].dtype and a[1].dtype == b[1].dtype and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batches_are_arraydatasets_for_any_worker_count_and_resume() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 2, 3, 3, generator=g), torch.randint(0, 5, (40,), generator=g)
    xv, yv = torch.randn(9, 2, 3, 3, generator=g), torch.randint(0, 5, (9,), generator=g)
    ref = ArrayDataset(x, y, xv, yv, num_classes=5, seed=7)
    sources = {w: TorchData(TensorSet(x, y, 5), TensorSet(xv, yv, 5), seed=7, workers=w) for w in (0, 2)}
    steps = [0, 0, 1, 2, 3, 4, 9, 5, 6]  # 3 per epoch at batch 12; out of order: a restart there (a resume)
    for w, data in sources.items():
        assert data.input_shape == (2, 3, 3) and data.num_classes == 5
        for k in steps:
            assert equal(data.train_batch(k, 12), ref.train_batch(k, 12)), (w, k)
        part = data.train_batch(6, 12, rows=range(4, 8))  # a replica's share: only its rows are read
        assert equal(part, tuple(t[4:8] for t in ref.train_batch(6, 12)))
        assert all(equal(a, b) for a, b in zip(data.val_batches(4), ref.val_batches(4), strict=True))
        assert all(equal(a, b) for a, b in zip(data.calib_batches(3, 16), ref.calib_batches(3, 16), strict=True))
    resumed = TorchData(TensorSet(x, y, 5), TensorSet(xv, yv, 5), seed=7, workers=2)
    assert equal(resumed.train_batch(5, 12), ref.train_batch(5, 12))


def test_image_folder_and_cifar_read_pixels_and_labels(disk: Path) -> None:
    train = ImageFolder(disk / "images" / "train")
    assert train.classes == list(CLASSES) and len(train) == 36
    path, label = train.samples[13]
    x, y = train[13]
    want = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255
    assert (y, label, path.parent.name) == (1, 1, "dog") and torch.equal(x, want)

    cifar = Cifar10(disk / "cifar", mean=[0.5] * 3, std=[0.25] * 3)
    with (disk / "cifar" / "data_batch_2").open("rb") as f:
        raw = pickle.load(f)
    x, y = cifar[12]  # the second batch's first row
    want = (torch.from_numpy(raw[b"data"][0]).view(3, 32, 32).float() / 255 - 0.5) / 0.25
    assert y == raw[b"labels"][0] and torch.equal(x, want)
    assert len(cifar) == 36 and len(Cifar10(disk / "cifar", train=False)) == 12 and cifar.classes[3] == "c3"


def test_augmentation_is_seeded_per_sample_whatever_the_workers(disk: Path) -> None:
    def data(workers: int) -> TorchData:
        train = ImageFolder(disk / "images" / "train", flip=True, crop_padding=2)
        return TorchData(train, ImageFolder(disk / "images" / "val", classes=train.classes), seed=3, workers=workers)

    a, b = data(0), data(2)
    state = torch.get_rng_state()
    batches = [a.train_batch(k, 12) for k in range(6)]
    assert torch.equal(torch.get_rng_state(), state)  # the process's own stream did not move
    assert all(equal(b.train_batch(k, 12), batches[k]) for k in range(6))
    plain = TorchData(ImageFolder(disk / "images" / "train"), ImageFolder(disk / "images" / "val"), seed=3, workers=0)
    changed = [not torch.equal(plain.train_batch(k, 12)[0], batches[k][0]) for k in range(6)]
    assert all(changed)  # the same samples (same order), augmented
    assert equal(data(0).train_batch(4, 12), batches[4])  # started at step 4 (a resume): the same draws


def test_digits_through_a_dataloader_train_exactly_as_arraydataset(tmp_path: Path) -> None:
    ref = run(make_cfg(), output_dir=tmp_path / "array")
    got = run(make_cfg(*DIGITS_LOADER, "+data.workers=2"), output_dir=tmp_path / "loader")
    assert got["params_digest"] == ref["params_digest"]
    assert got["best"] == ref["best"]


def test_nested_targets_name_their_keys(tmp_path: Path) -> None:
    cases = [
        (["+data.train={_target_: search.torch_data.digits, splt: train}"],
         "data.train.splt: unknown option for search.torch_data.digits"),
        (["+data.train={_target_: search.torch_data.ImageFolder, root: /nonexistent}"],
         "data.train.root: expected a directory with one sub-directory per class, found '/nonexistent'"),
        (["+data.train={_target_: search.torch_data.digits}", "+data.val={_target_: search.torch_data.nope}"],
         "data.val._target_: cannot import 'search.torch_data.nope'"),
    ]
    for extra, message in cases:
        base = ["~data", "+data._target_=search.torch_data.TorchData"]
        val = [] if any(e.startswith("+data.val") for e in extra) else ["+data.val={_target_: search.torch_data.digits}"]
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            run(make_cfg(*base, *extra, *val), output_dir=tmp_path / "run")
        assert not (tmp_path / "run").exists()


def test_presets_from_the_command_line(disk: Path, tmp_path: Path) -> None:
    """Both presets run and exit 0; bad roots exit 2 with one line naming data.root, nothing written."""
    d = str(disk)
    cases = [
        Case(["data=image_folder", "data.root=images", "data.flip=true", *SHORT, "hydra.run.dir=runs/folder"], d),
        Case(["data=cifar10", "data.root=cifar", "data.workers=0", *SHORT, "hydra.run.dir=runs/cifar"], d),
        Case(["data=image_folder", *SHORT, "hydra.run.dir=runs/bad1"], d),
        Case(["data=image_folder", "data.root=cifar", *SHORT, "hydra.run.dir=runs/bad2"], d),
        Case(["data=cifar10", "data.root=images", *SHORT, "hydra.run.dir=runs/bad3"], d),
    ]
    ok_folder, ok_cifar, *bad = run_cases(cases)
    for r in (ok_folder, ok_cifar):
        assert r.status == 0, r.stderr[-3000:]
    summary = json.loads((disk / "runs" / "folder" / "summary.json").read_text())
    assert summary["data"] == {"input_shape": [3, 8, 8], "num_classes": 3}
    assert json.loads((disk / "runs" / "cifar" / "summary.json").read_text())["data"]["input_shape"] == [3, 32, 32]
    expected = [
        "error: data.root: missing; expected a directory holding train/ and val/ (each <class>/<image>), "
        "e.g. data.root=path/to/data",
        "error: data.root: expected a directory holding train/ and val/ (each <class>/<image>), found 'cifar' "
        "(no train/, val/ in it)",
        "error: data.root: expected CIFAR-10's python batch files (data_batch_1 .. data_batch_5; the unpacked "
        "cifar-10-python.tar.gz), found none in 'images'",
    ]
    for r, line in zip(bad, expected, strict=True):
        assert r.status == 2 and r.errors == [line] and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any((disk / "runs" / f"bad{i}").exists() for i in (1, 2, 3))


@pytest.mark.dist
def test_torchrun_image_folder_equals_one_process(disk: Path) -> None:
    """P = 2 stages under torchrun, two workers per rank: the one-process run's params_digest."""
    args = ["data=image_folder", "data.root=images", "data.flip=true", "data.crop_padding=1", *SHORT]
    (one,) = run_cases([Case([*args, "hydra.run.dir=runs/one"], str(disk))])
    assert one.status == 0, one.stderr[-3000:]
    p = torchrun_search([*args, "pipeline.stages=2", "hydra.run.dir=runs/two"], disk, timeout_s=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    digest = lambda d: json.loads((disk / "runs" / d / "summary.json").read_text())["params_digest"]  # noqa: E731
    assert digest("two") == digest("one")
