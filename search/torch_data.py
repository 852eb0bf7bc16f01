"""Map-style torch datasets as a data source: :class:`TorchData` serves the dataset protocol of
``search.data`` from any ``torch.utils.data.Dataset`` through a ``DataLoader``; :class:`ImageFolder`
and :class:`Cifar10` (``search.image_files``) read the two common on-disk formats with Pillow and
pickle (torchvision is not needed; its datasets work too); :func:`image_folder` and :func:`cifar10` are the presets'
targets (``conf/data/``).

**Which samples.** Step ``t`` reads the indices :class:`search.data.EpochOrder` gives (the rule
``ArrayDataset`` uses), in that order, and the collate stacks them as ``ArrayDataset`` indexes
its tensors: a resumed run, every pipeline layout and every ``workers`` count see the same
batches, and the same tensors through a ``TensorDataset`` are ``ArrayDataset``'s bit for bit.

**Augmentation, seeded per sample.** Before row ``i`` of step ``t`` is read, torch's global
generator (what torchvision's transforms and this module's flips and crops draw from) is seeded
with ``derive_seed(seed, "augment", t, i)`` in the process that reads it, and restored after, so
no process's own stream moves. Validation rows are seeded by ``(seed, "val", i)``, calibration
rows by ``(seed, "calib", b, i)``.

**Workers.** ``workers`` processes read the steps after the one asked for (``prefetch`` batches
each, ahead); a step asked out of order (a resume, the app's check of step 0) restarts them there;
evaluation stops them. Every wait on a worker has ``timeout_s``.
"""
from __future__ import annotations

import argparse
import pickle
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from supernet import derive_seed

from .data import DataError, EpochOrder, calib_indices, check_batch_size
from .image_files import Cifar10, ImageFolder, named_error, option_error

__all__ = ["TorchData", "ImageFolder", "Cifar10", "TensorSet", "image_folder", "cifar10", "digits", "write_digits"]

Batch = tuple[torch.Tensor, torch.Tensor]


# -- the adapter -----------------------------------------------------------------------------

class _Seeded(torch.utils.data.Dataset):
    """``dataset[i]`` read under torch's global generator seeded for that row: keys ``(i, seed)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        g = torch.default_generator  # what torch.rand & co. draw from; torch.manual_seed costs ~40x more
        state = g.get_state()
        g.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            g.set_state(state)


class _Collate:
    """Samples ``(x, label)`` -> ``(x float32 (B, *shape), y int64 (B,))``, as ``ArrayDataset``'s."""

    def __init__(self, split: str, num_classes: int) -> None:
        self.split, self.num_classes = split, num_classes

    def __call__(self, samples: list[Any]) -> Batch:
        xs = [s[0] for s in samples]
        bad = next((x for x in xs if not isinstance(x, torch.Tensor)), None)
        if bad is not None:
            raise DataError(f"data.{self.split}: expected samples (tensor, label), found a {type(bad).__name__}; give "
                            "the dataset a transform that makes tensors (e.g. torchvision.transforms.ToTensor())")
        try:
            x = torch.stack(xs).float()
        except RuntimeError:
            shapes = sorted({tuple(t.shape) for t in xs})
            raise DataError(f"data.{self.split}: expected samples of one shape, found {shapes}; "
                            "resize them (image_folder: data.size=[H,W])") from None
        y = torch.tensor([int(s[1]) for s in samples], dtype=torch.int64)
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise DataError(f"data.{self.split}: expected labels in [0, {self.num_classes}), found "
                            f"{int(y.min())}..{int(y.max())}; set data.num_classes")
        return x, y


class _Steps:
    """The batch sampler of training: step ``start``, ``start + 1``, ... (endless), each the keys
    of rows ``rows`` of that step's batch."""

    def __init__(self, seed: int, size: int, start: int, batch_size: int, rows: range) -> None:
        self.order, self.seed = EpochOrder(seed, size), seed
        self.start, self.batch_size, self.rows = start, batch_size, rows

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start
        while True:
            idx = self.order.indices(step, self.batch_size)
            yield [(int(idx[i]), derive_seed(self.seed, "augment", step, i)) for i in self.rows]
            step += 1


def _build(value: Any, path: str) -> Any:
    """A ``_target_`` mapping built (its own nested targets first), errors naming ``path``."""
    from .config import _HYDRA_KEYS, ConfigError, TargetConfig, _instantiate  # (config imports data, not this)

    if not (isinstance(value, Mapping) and "_target_" in value):
        return value
    plain, built = {}, {}
    for k, v in value.items():
        if k in _HYDRA_KEYS:
            continue
        if isinstance(v, Mapping) and "_target_" in v:
            built[k] = _build(v, f"{path}.{k}")
        elif isinstance(v, list) and any(isinstance(e, Mapping) and "_target_" in e for e in v):
            built[k] = [_build(e, f"{path}.{k}[{i}]") for i, e in enumerate(v)]
        else:
            plain[k] = v
    try:
        return _instantiate(TargetConfig(path, str(value["_target_"]), plain), built)
    except ConfigError as e:  # "train.root: ...": the config names it "data.train.root: ..."
        raise named_error(str(e), path) from None


class TorchData:
    """The dataset protocol over map-style datasets ``train`` and ``val`` (datasets, or
    ``_target_`` mappings built here: ``data.train._target_: torchvision.datasets.CIFAR10``).
    A sample is ``(x, label)``: ``x`` a tensor of one shape (``input_shape``), the label an int.
    ``num_classes``: from the option, else ``len(train.classes)``. ``train_batch``'s ``rows``
    (positions in the step's batch) reads only those rows: a replica's share."""

    def __init__(self, train: Any, val: Any, seed: int = 0, num_classes: int | None = None, workers: int = 2,
                 pin_memory: bool = True, prefetch: int = 2, timeout_s: float = 300.0) -> None:
        self.train, self.val = _build(train, "train"), _build(val, "val")
        for split, ds in (("train", self.train), ("val", self.val)):
            if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
                raise option_error(split, f"expected a map-style torch Dataset (with __getitem__ and __len__), "
                                          f"found {type(ds).__name__}")
            if len(ds) == 0:
                raise option_error(split, "expected a non-empty dataset, found 0 samples")
        for key, v, lo in (("workers", workers, 0), ("prefetch", prefetch, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise option_error(key, f"expected an integer >= {lo}, found {v!r}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise option_error("timeout_s", f"expected a positive number of seconds, found {timeout_s!r}")
        self.seed, self.workers, self.prefetch, self.timeout_s = int(seed), workers, prefetch, float(timeout_s)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()  # pinning needs a CUDA device
        classes = getattr(self.train, "classes", None)
        if num_classes is None and classes is None:
            raise option_error("num_classes", f"missing; {type(self.train).__name__} has no `classes`, so give "
                                              "the number of classes (e.g. data.num_classes=10)")
        self.num_classes = int(num_classes if num_classes is not None else len(classes))
        x, _ = _Seeded(self.train)[(0, derive_seed(self.seed, "augment", 0, 0))]
        vx, _ = _Seeded(self.val)[(0, derive_seed(self.seed, "val", 0))]
        for split, t in (("train", x), ("val", vx)):
            if not isinstance(t, torch.Tensor):
                raise option_error(split, f"expected samples (tensor, label), found a {type(t).__name__}; give the "
                                          "dataset a transform that makes tensors")
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in x.shape)
        if tuple(vx.shape) != self.input_shape:
            raise option_error("val", f"expected samples of the training set's shape {list(self.input_shape)}, "
                                      f"found {list(vx.shape)}")
        self._stream: tuple[tuple[int, range], int, Iterator[Batch]] | None = None  # (key, next step, batches)
        self._last: tuple[int, tuple[int, range], Batch] | None = None

    def _loader(self, split: str, batches: Any) -> DataLoader:
        w = self.workers
        return DataLoader(_Seeded(getattr(self, split)), batch_sampler=batches, num_workers=w,
                          collate_fn=_Collate(split, self.num_classes), pin_memory=self.pin_memory,
                          prefetch_factor=self.prefetch if w else None, timeout=self.timeout_s if w else 0,
                          generator=torch.Generator().manual_seed(0))  # leaves the global stream alone

    def train_batch(self, step: int, batch_size: int, rows: range | None = None) -> Batch:
        """Step ``step``'s batch (rows ``rows`` of it only, when given): ``EpochOrder``'s indices."""
        check_batch_size(batch_size, len(self.train), "train.batch_size")
        rows = range(batch_size) if rows is None else rows
        if rows.step != 1 or not 0 <= rows.start < rows.stop <= batch_size:
            raise DataError(f"rows: expected a range within the batch [0, {batch_size}), found {rows}")
        key = (batch_size, rows)
        if self._last is not None and self._last[:2] == (step, key):
            return self._last[2]  # asked again (the app checks step 0 before training from it)
        if self._stream is None or self._stream[:2] != (key, step):
            self.close()
            steps = _Steps(self.seed, len(self.train), step, batch_size, rows)
            self._stream = (key, step, iter(self._loader("train", steps)))
        key, _, it = self._stream
        batch = next(it)
        self._stream, self._last = (key, step + 1, it), (step, key, batch)
        return batch

    def val_batches(self, batch_size: int) -> list[Batch]:
        """The whole validation set in order; the last batch may be smaller."""
        check_batch_size(batch_size, None, "search.val_batch_size")
        self.close()  # training is over: free its workers and what they read ahead
        n = len(self.val)
        keys = [[(i, derive_seed(self.seed, "val", i)) for i in range(a, min(a + batch_size, n))]
                for a in range(0, n, batch_size)]
        return list(self._loader("val", keys))

    def calib_batches(self, n: int, batch_size: int) -> list[Batch]:
        """``n`` batches of training samples for batch-norm recalibration, fixed by the seed."""
        self.close()
        keys = [[(int(i), derive_seed(self.seed, "calib", b, p)) for p, i in enumerate(idx)]
                for b, idx in enumerate(calib_indices(self.seed, len(self.train), n, batch_size))]
        return list(self._loader("train", keys)) if keys else []

    def close(self) -> None:
        """Stop the training stream's workers (a later ``train_batch`` starts them again)."""
        self._stream = None  # the iterator's finaliser shuts its workers down


class TensorSet(TensorDataset):
    """A ``TensorDataset`` of inputs and labels that knows its classes (for ``num_classes``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> None:
        super().__init__(x, y)
        self.classes = [str(i) for i in range(num_classes)]


def digits(split: str = "train", val_fraction: float = 0.2, split_seed: int = 0) -> TensorSet:
    """``search.data.Digits``' training or validation tensors as a map-style dataset (the same
    values: the digits through :class:`TorchData` train exactly as through ``ArrayDataset``)."""
    from .data import Digits

    if split not in ("train", "val"):
        raise option_error("split", f"expected 'train' or 'val', found {split!r}")
    d = Digits(val_fraction=val_fraction, split_seed=split_seed)
    return TensorSet(d.x_train, d.y_train, 10) if split == "train" else TensorSet(d.x_val, d.y_val, 10)


# -- presets -----------------------------------------------------------------------------------

def image_folder(root: str | None, seed: int = 0, train_dir: str = "train", val_dir: str = "val",
                 size: Sequence[int] | None = None, channels: int = 3, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None, flip: bool = False, crop_padding: int = 0, workers: int = 2,
                 pin_memory: bool = True, prefetch: int = 2, timeout_s: float = 300.0) -> TorchData:
    """``conf/data/image_folder.yaml``: ``root/<train_dir>`` and ``root/<val_dir>``, each an
    :class:`ImageFolder` (augmentation on the training set only)."""
    base = _root(root, (train_dir, val_dir), "<class>/<image>")
    common = dict(size=size, channels=channels, mean=mean, std=std)
    train = ImageFolder(base / train_dir, flip=flip, crop_padding=crop_padding, **common)
    val = ImageFolder(base / val_dir, classes=train.classes, **common)
    return TorchData(train, val, seed, None, workers, pin_memory, prefetch, timeout_s)


def cifar10(root: str | None, seed: int = 0, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
            flip: bool = False, crop_padding: int = 0, workers: int = 2, pin_memory: bool = True, prefetch: int = 2,
            timeout_s: float = 300.0) -> TorchData:
    """``conf/data/cifar10.yaml``: :class:`Cifar10`'s training and test batches."""
    base = _root(root, (), "data_batch_1 .. data_batch_5 and test_batch")
    train = Cifar10(base, True, mean, std, flip, crop_padding)
    val = Cifar10(base, False, mean, std)
    return TorchData(train, val, seed, None, workers, pin_memory, prefetch, timeout_s)


def _root(root: str | None, subdirs: Sequence[str], holding: str) -> Path:
    want = (f"a directory holding {' and '.join(f'{d}/' for d in subdirs)} (each {holding})" if subdirs
            else f"a directory holding {holding}")
    if root is None or root == "":
        raise option_error("root", f"missing; expected {want}, e.g. data.root=path/to/data")
    base = Path(str(root)).expanduser()
    missing = [d for d in subdirs if not (base / d).is_dir()]
    if not base.is_dir() or missing:
        found = ("no such directory" if not base.exists() else "a file" if not base.is_dir()
                 else f"no {', '.join(f'{d}/' for d in missing)} in it")
        raise option_error("root", f"expected {want}, found {str(root)!r} ({found})")
    return base


# -- example data on disk ----------------------------------------------------------------------

def write_digits(out: str | Path, fmt: str) -> Path:
    """scikit-learn's digits on disk, to try the presets: ``image_folder`` (8x8 grey PNGs in
    ``out/{train,val}/<digit>/``) or ``cifar10`` (scaled 4x to 32x32 RGB, five ``data_batch_<n>``
    and a ``test_batch``). The split is ``search.data.Digits``'."""
    from .data import Digits

    d = Digits()
    out = Path(out)
    splits = {"train": (d.x_train, d.y_train), "val": (d.x_val, d.y_val)}
    lo, hi = float(d.x_train.min()), float(d.x_train.max())  # Digits is normalised: back to 0..255
    to_u8 = lambda x: ((x - lo) / (hi - lo) * 255).round().clamp(0, 255).to(torch.uint8)  # noqa: E731
    if fmt == "image_folder":
        from PIL import Image

        for split, (x, y) in splits.items():
            for i, (img, label) in enumerate(zip(to_u8(x[:, 0]), y.tolist())):
                (out / split / str(label)).mkdir(parents=True, exist_ok=True)
                Image.fromarray(img.numpy()).save(out / split / str(label) / f"{i:04d}.png")
    elif fmt == "cifar10":
        out.mkdir(parents=True, exist_ok=True)
        big = {k: (to_u8(x).repeat_interleave(4, -1).repeat_interleave(4, -2).expand(-1, 3, -1, -1), y)
               for k, (x, y) in splits.items()}  # (N, 3, 32, 32)
        x, y = big["train"]
        for n, idx in enumerate(torch.arange(len(y)).chunk(5), start=1):
            _dump(out / f"data_batch_{n}", x[idx], y[idx])
        _dump(out / "test_batch", *big["val"])
        with (out / "batches.meta").open("wb") as f:
            pickle.dump({b"label_names": [str(i).encode() for i in range(10)]}, f)
    else:
        raise ValueError(f"format: expected 'image_folder' or 'cifar10', found {fmt!r}")
    return out


def _dump(path: Path, x: torch.Tensor, y: torch.Tensor) -> None:
    with path.open("wb") as f:
        pickle.dump({b"data": x.reshape(len(x), -1).numpy().copy(), b"labels": y.tolist()}, f)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m search.torch_data --digits {image_folder,cifar10} DIR``: example data on disk."""
    parser = argparse.ArgumentParser(prog="python -m search.torch_data", description=main.__doc__)
    parser.add_argument("--digits", choices=("image_folder", "cifar10"), required=True,
                        help="write scikit-learn's digits in this format")
    parser.add_argument("dir", help="where (made if missing)")
    args = parser.parse_args(argv)
    print(f"wrote {write_digits(args.dir, args.digits)} ({args.digits})")


if __name__ == "__main__":
    main()
