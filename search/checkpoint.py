"""Checkpoints of a search run, and atomic file writes.

A checkpoint holds everything a run needs to continue as if never stopped: the format
version, the number of training steps done, every op's flat state (weights, buffers and
optimizer state, as :meth:`pipeline.Engine.op_states` gives them), the sampler state and
the digests of the config. Files are written atomically — to a temporary file in the same
directory, flushed and fsynced, then ``os.replace``-d over the target — so a reader sees the
old file or the new one, never half of one.
"""
from __future__ import annotations

import io
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT_VERSION", "CHECKPOINT_NAME", "Checkpoint", "CheckpointError", "save_checkpoint",
           "load_checkpoint", "atomic_write_bytes", "atomic_write_text"]

FORMAT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint is unreadable, of another format, or from another run."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # training steps done; the run continues at this step index
    op_states: Mapping[str, Mapping[str, torch.Tensor]]
    sampler: Mapping[str, Any]
    train_digest: str  # digest of the config fields that decide training; must match to resume
    config_digest: str  # digest of the whole config that wrote it (informational)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION, "step": self.step,
            "op_states": {k: dict(v) for k, v in self.op_states.items()},
            "sampler": dict(self.sampler), "train_digest": self.train_digest,
            "config_digest": self.config_digest,
        }


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name beside the target (same filesystem, so os.replace is atomic); opened
    # exclusively, with the usual permissions (umask), unlike tempfile's private 0600 files.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, ckpt: Checkpoint) -> None:
    buf = io.BytesIO()
    torch.save(ckpt.to_dict(), buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint at ``path``, or ``None`` if there is none. Tensors load on the CPU."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: cannot read it ({type(e).__name__}: {e}); move it away to start afresh"
        ) from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"checkpoint {path}: expected format version {FORMAT_VERSION}, found {found!r}")
    try:
        return Checkpoint(int(data["step"]), data["op_states"], data["sampler"], str(data["train_digest"]),
                          str(data["config_digest"]))
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path}: missing field {e.args[0]!r}") from None
