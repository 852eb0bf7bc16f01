"""Datasets for supernet training and search: digits, synthetic, and the dataset protocol.

A dataset offers ``input_shape`` (one sample), ``num_classes``, ``train_batch(step,
batch_size)`` — a pure function of ``(seed, step)``: each epoch is a permutation seeded by
``(seed, epoch)``, so a resumed run sees the same batches — ``val_batches(batch_size)`` and
``calib_batches(n, batch_size)`` (training samples for batch-norm recalibration, fixed by the
seed). Any object with these members works; select one with ``_target_`` in the data config.
A ``train_batch`` that also takes ``rows`` (a range of the batch's rows) lets each pipeline
replica read only its micro-batches' rows; without it every rank reads the whole batch.
"""
from __future__ import annotations

import hashlib
import math
import os
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from supernet import derive_seed

__all__ = ["Dataset", "DataError", "EpochOrder", "calib_indices", "check_batch_size", "ArrayDataset", "Digits",
           "Synthetic", "digits_split"]

Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ValueError):
    """A dataset was configured or asked for with bad input."""


@runtime_checkable
class Dataset(Protocol):
    input_shape: tuple[int, ...]
    num_classes: int

    def train_batch(self, step: int, batch_size: int) -> Batch: ...  # may take rows=range: only those rows

    def val_batches(self, batch_size: int) -> list[Batch]: ...

    def calib_batches(self, n: int, batch_size: int) -> list[Batch]: ...


def check_batch_size(batch_size: int, n: int | None, field: str) -> None:
    """A batch size is a positive integer, at most ``n`` (the training set size) when given."""
    ok = isinstance(batch_size, int) and batch_size >= 1 and (n is None or batch_size <= n)
    if not ok:
        bound = "a positive integer" if n is None else f"an integer between 1 and {n} (the training set size)"
        raise DataError(f"{field}: expected {bound}, found {batch_size!r}")


class EpochOrder:
    """The one rule for which training samples step ``t`` reads: epochs of ``size // batch_size``
    batches (the rest dropped), each epoch a permutation of ``range(size)`` seeded by ``(seed,
    epoch)``. Every data source that batches by index uses it, so they see the same batches."""

    def __init__(self, seed: int, size: int) -> None:
        self.seed, self.size = int(seed), int(size)
        self._perm: tuple[int, torch.Tensor] | None = None  # the last epoch's, reused by its steps

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            self._perm = (epoch, torch.randperm(self.size, generator=g))
        return self._perm[1]

    def indices(self, step: int, batch_size: int) -> torch.Tensor:
        """Step ``step``'s sample indices, in batch order: int64 ``(batch_size,)``."""
        check_batch_size(batch_size, self.size, "train.batch_size")
        epoch, i = divmod(step, self.size // batch_size)
        return self.permutation(epoch)[i * batch_size : (i + 1) * batch_size]


def calib_indices(seed: int, size: int, n: int, batch_size: int) -> list[torch.Tensor]:
    """``n`` batches of training-sample indices for batch-norm recalibration, fixed by the seed."""
    if n <= 0:
        return []
    check_batch_size(batch_size, size, "search.calib_batch_size")
    g = torch.Generator().manual_seed(derive_seed(seed, "calib"))
    reps = math.ceil(n * batch_size / size)
    idx = torch.cat([torch.randperm(size, generator=g) for _ in range(reps)])
    return [idx[i * batch_size : (i + 1) * batch_size] for i in range(n)]


class ArrayDataset:
    """In-memory train and validation tensors with seeded, epoch-wise batching.

    ``x_*`` are float32 ``(N, *input_shape)``, ``y_*`` int64 ``(N,)`` class indices.
    """

    def __init__(self, x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor,
                 y_val: torch.Tensor, num_classes: int, seed: int = 0) -> None:
        if x_train.shape[0] != y_train.shape[0] or x_val.shape[0] != y_val.shape[0]:
            raise DataError(
                f"data: inputs and labels differ in length: train {x_train.shape[0]} vs {y_train.shape[0]}, "
                f"val {x_val.shape[0]} vs {y_val.shape[0]}"
            )
        if x_train.shape[0] == 0 or x_val.shape[0] == 0:
            raise DataError(f"data: expected non-empty train and val sets, found {x_train.shape[0]} and {x_val.shape[0]}")
        self.x_train, self.y_train = x_train.float().contiguous(), y_train.long().contiguous()
        self.x_val, self.y_val = x_val.float().contiguous(), y_val.long().contiguous()
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in x_train.shape[1:])
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self._order = EpochOrder(self.seed, self.train_size)

    @property
    def train_size(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def val_size(self) -> int:
        return int(self.x_val.shape[0])

    def train_batch(self, step: int, batch_size: int, rows: range | None = None) -> Batch:
        """Batch ``step``: epochs of ``train_size // batch_size`` batches (the rest dropped); with
        ``rows``, only those rows of it (a replica's share)."""
        idx = self._order.indices(step, batch_size)
        if rows is not None:
            idx = idx[rows.start:rows.stop]
        return self.x_train[idx], self.y_train[idx]

    def val_batches(self, batch_size: int) -> list[Batch]:
        """The whole validation set in order; the last batch may be smaller."""
        check_batch_size(batch_size, None, "search.val_batch_size")
        return [(self.x_val[i : i + batch_size], self.y_val[i : i + batch_size])
                for i in range(0, self.val_size, batch_size)]

    def calib_batches(self, n: int, batch_size: int) -> list[Batch]:
        """``n`` batches of training samples for batch-norm recalibration, fixed by the seed."""
        return [(self.x_train[idx], self.y_train[idx])
                for idx in calib_indices(self.seed, self.train_size, n, batch_size)]


class Digits(ArrayDataset):
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes; ships with
    scikit-learn, no download), as ``(N, 1, 8, 8)`` float32 scaled to [0, 1] then normalized
    by the training set's mean and std, with a fixed stratified train/validation split."""

    def __init__(self, seed: int = 0, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction: expected a number in (0, 1), found {val_fraction!r}")
        x_tr, x_va, y_tr, y_va = digits_split(val_fraction, split_seed)
        mean, std = float(x_tr.mean()), float(x_tr.std())
        super().__init__(torch.from_numpy((x_tr - mean) / std), torch.from_numpy(y_tr),
                         torch.from_numpy((x_va - mean) / std), torch.from_numpy(y_va), 10, seed)


_SPLIT = ("x_train", "x_val", "y_train", "y_val")


def digits_split(val_fraction: float, split_seed: int,
                 cache_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, ...]:
    """The digits scaled to [0, 1] and split (stratified): ``x_train, x_val, y_train, y_val``.

    Kept in the cache (``$PIPENAS_CACHE`` or ``~/.cache/pipenas``) as a ``.npz`` keyed by the
    scikit-learn version and the split's settings: importing scikit-learn took 1.4-2.3 s of every
    process's start here (each rank of a job loads the data), while the arrays never change. A
    cache file that cannot be read is made again; a cache that cannot be written is skipped."""
    from pipeline.files import atomic_write
    from pipeline.profile import default_cache_dir

    try:
        sklearn_version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        sklearn_version = "none"  # the import below names what is missing
    key = hashlib.sha256(f"digits|{sklearn_version}|{val_fraction!r}|{split_seed}".encode()).hexdigest()[:32]
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"digits-{key}.npz"
    try:
        with np.load(path) as z:
            return tuple(z[k] for k in _SPLIT)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # absent or unreadable: made again below
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8)
    y = digits.target.astype(np.int64)
    arrays = tuple(train_test_split(x, y, test_size=val_fraction, random_state=split_seed, stratify=y))
    try:
        atomic_write(path, lambda f: np.savez(f, **dict(zip(_SPLIT, arrays))))
    except OSError:
        pass  # a read-only cache: load from scikit-learn each time
    return arrays


class Synthetic(ArrayDataset):
    """Gaussian inputs of any shape, labelled by a fixed random linear teacher (so a model can
    learn them); for benchmarks. ``teacher_seed`` fixes the data, ``seed`` the batch order."""

    def __init__(self, input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10, size: int = 2048,
                 val_size: int = 512, seed: int = 0, teacher_seed: int = 0) -> None:
        shape = tuple(input_shape)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise DataError(f"data.input_shape: expected a list of positive integers, found {list(shape)}")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise DataError(f"data.num_classes: expected an integer >= 2, found {num_classes!r}")
        for name, n in (("size", size), ("val_size", val_size)):
            if not isinstance(n, int) or n < 1:
                raise DataError(f"data.{name}: expected a positive integer, found {n!r}")
        g = torch.Generator().manual_seed(derive_seed(teacher_seed, "synthetic"))
        x = torch.randn((size + val_size, *shape), generator=g)
        d = math.prod(shape)
        teacher = torch.randn(d, num_classes, generator=g) / math.sqrt(d)
        y = (x.flatten(1) @ teacher).argmax(-1)
        super().__init__(x[:size], y[:size], x[size:], y[size:], num_classes, seed)
