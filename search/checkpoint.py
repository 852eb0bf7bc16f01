"""Checkpoints of a search run (written atomically: :mod:`pipeline.files`).

A checkpoint holds everything a run needs to continue as if never stopped: the format
version, the number of training steps done, every op's flat state (weights, buffers and
optimizer state, as :meth:`pipeline.Engine.op_states` gives them), the sampler state and
the digests of the config. Files are written atomically — to a temporary file in the same
directory, flushed and fsynced, then ``os.replace``-d over the target — so a reader sees the
old file or the new one, never half of one.

The checkpoint before the latest is kept beside it (``checkpoint.prev.pt``): a new checkpoint is
written and fsynced under a temporary name first, then the latest becomes the previous and the
new one the latest, so a durable checkpoint exists at every moment. :func:`resume_checkpoint`
falls back to the previous one, with a warning naming both, when the latest cannot be read, and
names both when neither can. A checkpoint keeps the training fields of its run
(:func:`search.config.train_fields`), so a refused resume can name the fields that changed.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.files import atomic_write, atomic_write_bytes, atomic_write_text

__all__ = ["FORMAT_VERSION", "CHECKPOINT_NAME", "SUMMARY_NAME", "PREVIOUS_NAME", "Checkpoint", "CheckpointError", "save_checkpoint",
           "load_checkpoint", "resume_checkpoint", "remove_temporaries", "previous_path", "atomic_write_bytes",
           "atomic_write_text"]

FORMAT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"
SUMMARY_NAME = "summary.json"  # the run's result, beside its checkpoint (search.app writes it)
PREVIOUS_NAME = "checkpoint.prev.pt"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is unreadable, of another format, or from another run."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # training steps done; the run continues at this step index
    op_states: Mapping[str, Mapping[str, torch.Tensor]]
    sampler: Mapping[str, Any]
    train_digest: str  # digest of the config fields that decide training; must match to resume
    config_digest: str  # digest of the whole config that wrote it (informational)
    train_config: Mapping[str, Any] | None = None  # the fields the train digest covers (None: older checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION, "step": self.step,
            "op_states": {k: dict(v) for k, v in self.op_states.items()},
            "sampler": dict(self.sampler), "train_digest": self.train_digest,
            "config_digest": self.config_digest,
            **({"train_config": self.train_config} if self.train_config is not None else {}),
        }


def previous_path(path: str | os.PathLike) -> Path:
    """Where the checkpoint before the one at ``path`` is kept."""
    path = Path(path)
    return path.with_name(PREVIOUS_NAME if path.name == CHECKPOINT_NAME else f"{path.stem}.prev{path.suffix}")


def save_checkpoint(path: str | os.PathLike, ckpt: Checkpoint, keep_previous: bool = True,
                    on_durable: Callable[[], None] | None = None) -> None:
    """Write ``ckpt`` atomically; the checkpoint it replaces becomes :func:`previous_path` unless
    ``keep_previous`` is false (the latest is known to be unreadable: the previous stays).
    ``on_durable``: see :func:`pipeline.files.atomic_write` (fault injection)."""
    state = ckpt.to_dict()
    atomic_write(path, lambda f: torch.save(state, f), previous_path(path) if keep_previous else None,
                 on_durable=on_durable)


START_AFRESH = "set resume=false (the new run's first checkpoint replaces what is there)"


def resume_checkpoint(path: str | os.PathLike,
                      warn: Callable[[str], None] | None = None) -> tuple[Checkpoint | None, Path | None]:
    """The checkpoint to resume from and its file: the latest at ``path``, or the previous one
    (with a warning naming both, to ``warn``, else this module's log) when the latest is missing
    or cannot be read; ``(None, None)`` when there is neither. Raises :class:`CheckpointError`,
    naming both files, when neither can be read."""
    path, prev = Path(path), previous_path(path)
    warn = warn if warn is not None else log.warning
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        if not prev.exists():
            raise CheckpointError(f"{e}; there is no previous checkpoint {prev} to fall back to; to start afresh "
                                  f"move {path} away, or {START_AFRESH}") from None
        latest = str(e)
        return _fall_back(prev, warn, f"cannot read the latest checkpoint {path} ({latest})",
                          lambda e_prev: f"neither checkpoint can be read: {latest}; {e_prev}; to start afresh move "
                                         f"both away, or {START_AFRESH}")
    if ckpt is not None:
        return ckpt, path
    if prev.exists():
        return _fall_back(prev, warn, f"no latest checkpoint {path} (a crash while replacing it)",
                          lambda e_prev: f"{e_prev}, and there is no latest checkpoint {path}; to start afresh move "
                                         f"{prev} away, or {START_AFRESH}")
    return None, None


def _fall_back(prev: Path, warn: Callable[[str], None], why: str,
               unreadable: Callable[[CheckpointError], str]) -> tuple[Checkpoint, Path]:
    """Resume from the previous checkpoint ``prev`` (the latest one cannot be used: ``why``),
    or stop with ``unreadable(error)`` when it cannot be read either."""
    try:
        fallback = load_checkpoint(prev)
    except CheckpointError as e_prev:
        raise CheckpointError(unreadable(e_prev)) from None
    warn(f"{why}; resuming from the previous one, {prev} (step {fallback.step})")
    return fallback, prev


def remove_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove what a process killed while writing the checkpoint at ``path`` (or its previous)
    left: their temporary files. Call it before any write of this run starts."""
    path = Path(path)
    gone = []
    for name in (path.name, previous_path(path).name):
        for tmp in path.parent.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
    return gone


def load_checkpoint(path: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint at ``path``, or ``None`` if there is none. Tensors load on the CPU."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: expected a file written by torch.save, found one torch cannot load "
                              f"({type(e).__name__}: {_one_line(str(e))})") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"checkpoint {path}: expected format version {FORMAT_VERSION}, found {found!r}")
    try:
        return Checkpoint(int(data["step"]), data["op_states"], data["sampler"], str(data["train_digest"]),
                          str(data["config_digest"]), data.get("train_config"))
    except KeyError as e:
        raise CheckpointError(f"checkpoint {path}: missing field {e.args[0]!r}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
