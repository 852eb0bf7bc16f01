"""The two common on-disk image formats as map-style torch datasets, read without torchvision:
:class:`ImageFolder` (``<root>/<class>/<image>``, Pillow) and :class:`Cifar10` (CIFAR-10's python
batch files, pickle). Their pixels become float tensors ``(C, H, W)``, optionally resized,
normalised, flipped and cropped in training (:class:`_Pixels`: random draws from torch's global
generator, which :class:`search.torch_data.TorchData` seeds per sample). Errors name the option
(``option_error``: the config prefixes its group, ``data.root``).
"""
from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import DataError

__all__ = ["ImageFolder", "Cifar10", "IMAGE_EXTENSIONS", "option_error", "named_error"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def option_error(option: str, text: str) -> DataError:
    """An error about one option, ``option: text``; the config prefixes its group (``data.root``,
    ``data.train.root``): ``search.config`` names an error that has ``.option`` under its group."""
    return named_error(f"{option}: {text}", option)


def named_error(text: str, option: str) -> DataError:
    e = DataError(text)
    e.option = option  # type: ignore[attr-defined]
    return e


class _Pixels:
    """uint8 ``(C, H, W)`` -> float in [0, 1], then (training) a random crop of a zero-padded
    image and a horizontal flip, then ``(x - mean) / std`` per channel, then ``transform``.
    Random draws come from torch's global generator (seeded per sample by :class:`TorchData`)."""

    def __init__(self, channels: int, mean: Sequence[float] | None, std: Sequence[float] | None, flip: bool,
                 crop_padding: int, transform: Callable[[torch.Tensor], Any] | None) -> None:
        for key, v in (("mean", mean), ("std", std)):
            if v is not None and (not isinstance(v, Sequence) or len(v) != channels
                                  or not all(isinstance(a, (int, float)) for a in v)):
                raise option_error(key, f"expected {channels} numbers (one per channel) or null, found {v!r}")
        if (mean is None) != (std is None) or (std is not None and not all(a > 0 for a in std)):
            raise option_error("std", f"expected positive numbers given with mean (or both null), found {std!r}")
        if not isinstance(crop_padding, int) or isinstance(crop_padding, bool) or crop_padding < 0:
            raise option_error("crop_padding", f"expected an integer >= 0, found {crop_padding!r}")
        if not isinstance(flip, bool):
            raise option_error("flip", f"expected true or false, found {flip!r}")
        shape = (channels, 1, 1)
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(shape)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(shape)
        self.flip, self.pad, self.transform = flip, crop_padding, transform

    def __call__(self, pixels: torch.Tensor) -> Any:
        x = pixels.float() / 255.0  # (C, H, W)
        if self.pad:
            h, w = x.shape[-2:]
            padded = torch.nn.functional.pad(x, (self.pad,) * 4)
            i, j = (int(v) for v in torch.randint(0, 2 * self.pad + 1, (2,)))
            x = padded[:, i : i + h, j : j + w]
        if self.flip and bool(torch.rand(()) < 0.5):
            x = x.flip(-1)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return self.transform(x) if self.transform is not None else x.contiguous()


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class>/.../<image>``: one sub-directory per class (sorted names: labels 0..C-1, or
    ``classes``: a validation set takes the training set's), images read with Pillow as
    ``channels`` (3: RGB, 1: grey), resized to ``size`` ``[H, W]`` when given (else every image
    must have the first one's size); samples ``(float (C, H, W), label)`` made by :class:`_Pixels`."""

    def __init__(self, root: str | Path, classes: Sequence[str] | None = None, size: Sequence[int] | None = None,
                 channels: int = 3, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 flip: bool = False, crop_padding: int = 0, transform: Callable | None = None) -> None:
        try:
            from PIL import Image
        except ImportError:
            raise option_error("root", "reading images needs Pillow: pip install 'pipenas[vision]'") from None
        root = Path(root)
        if not root.is_dir():
            raise option_error("root", f"expected a directory with one sub-directory per class, found {str(root)!r} "
                                       f"({'a file' if root.exists() else 'no such directory'})")
        found = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.classes = found if classes is None else list(classes)
        extra = sorted(set(found) - set(self.classes))
        if extra:
            raise option_error("root", f"expected class directories among the training set's {self.classes}, "
                                       f"found {extra} in {str(root)!r}")
        self.samples = [(p, label) for label, c in enumerate(self.classes) if (root / c).is_dir()
                        for p in sorted((root / c).rglob("*")) if p.suffix.lower() in IMAGE_EXTENSIONS]
        if not self.samples:
            raise option_error("root", f"expected images ({', '.join(IMAGE_EXTENSIONS)}) in class sub-directories "
                                       f"of {str(root)!r}, found {len(found)} sub-directories and no images")
        if channels not in (1, 3):
            raise option_error("channels", f"expected 1 (grey) or 3 (RGB), found {channels!r}")
        if size is not None and (not isinstance(size, Sequence) or len(size) != 2
                                 or not all(isinstance(v, int) and v > 0 for v in size)):
            raise option_error("size", f"expected [height, width] in pixels or null, found {size!r}")
        self.mode, self.size = "RGB" if channels == 3 else "L", None if size is None else (int(size[0]), int(size[1]))
        self.pixels = _Pixels(channels, mean, std, flip, crop_padding, transform)
        if self.size is None:
            with Image.open(self.samples[0][0]) as im:
                self._first = (im.height, im.width)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as im:
            im = im.convert(self.mode)
            if self.size is not None:
                im = im.resize((self.size[1], self.size[0]), Image.BILINEAR)
            elif (im.height, im.width) != self._first:
                raise DataError(f"{path}: {im.height}x{im.width} pixels, expected {self._first[0]}x{self._first[1]} "
                                "as the first image; resize them (data.size=[H,W])")
            a = np.asarray(im, dtype=np.uint8).reshape(im.height, im.width, -1)
        return self.pixels(torch.from_numpy(a.copy()).permute(2, 0, 1)), label


def _cifar_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    with path.open("rb") as f:
        d = pickle.load(f, encoding="bytes")  # the format is pickle (as torchvision reads it)
    d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()} if isinstance(d, dict) else {}
    data, labels = d.get("data"), d.get("labels")
    ok = (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072
          and labels is not None and len(labels) == len(data))
    if not ok:
        raise option_error("root", f"{str(path)!r}: expected a pickled dict with data (uint8, N x 3072) and N "
                                   f"labels, found keys {sorted(d)}")
    return data, [int(v) for v in labels]


class Cifar10(torch.utils.data.Dataset):
    """CIFAR-10's python batch files in ``root`` (or ``root/cifar-10-batches-py``, as the archive
    unpacks): ``data_batch_<n>`` (training, ``train=True``) or ``test_batch``, pickled dicts with
    ``data`` uint8 ``(N, 3072)`` (RGB planes of 32x32) and ``labels``; ``batches.meta``'s
    ``label_names`` are the classes when present. Samples as :class:`ImageFolder`'s."""

    def __init__(self, root: str | Path, train: bool = True, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None, flip: bool = False, crop_padding: int = 0,
                 transform: Callable | None = None) -> None:
        root = Path(root)
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        names: list[str] = []
        if root.is_dir() and train:
            names = sorted((p.name for p in root.iterdir() if re.fullmatch(r"data_batch_\d+", p.name)),
                           key=lambda n: int(n.rpartition("_")[2]))
        elif root.is_dir() and (root / "test_batch").is_file():
            names = ["test_batch"]
        if not names:
            want = "data_batch_1 .. data_batch_5" if train else "test_batch"
            raise option_error("root", f"expected CIFAR-10's python batch files ({want}; the unpacked "
                                       f"cifar-10-python.tar.gz), found {'none in' if root.is_dir() else 'no directory'} "
                                       f"{str(root)!r}")
        parts = [_cifar_batch(root / n) for n in names]
        self.data = torch.from_numpy(np.concatenate([d for d, _ in parts])).view(-1, 3, 32, 32)
        self.targets = [v for _, labels in parts for v in labels]
        labels = None
        if (root / "batches.meta").is_file():
            with (root / "batches.meta").open("rb") as f:
                meta = pickle.load(f, encoding="bytes")
            labels = meta.get(b"label_names", meta.get("label_names")) if isinstance(meta, dict) else None
        self.classes = ([n.decode() if isinstance(n, bytes) else str(n) for n in labels] if labels
                        else [str(i) for i in range(10)])
        self.pixels = _Pixels(3, mean, std, flip, crop_padding, transform)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.pixels(self.data[index]), self.targets[index]
