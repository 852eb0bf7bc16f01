"""``train.init_from``: an earlier run's checkpoint to start from (weights and buffers, a fresh
optimizer), read and checked against the space before anything is written (:func:`read_init_from`,
called by ``search.app.prepare``)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.memory.state import weight_shapes, weights_only
from supernet import OpSpec, SupernetGraph, build_op

from .checkpoint import CHECKPOINT_NAME, SUMMARY_NAME, CheckpointError, load_checkpoint
from .config import ConfigError



@dataclass(frozen=True)
class InitFrom:
    """``train.init_from`` as :func:`prepare` read it: the checkpoint file, the source run's
    ``params_digest`` (its ``summary.json``'s, when that sits beside its ``checkpoint.pt``), and
    the weights and buffers (no optimizer state) of the ops of this space it holds: ``states`` is
    ``None`` when the run resumes its own checkpoint, which holds the weights (the source is not read)."""

    path: Path
    source_digest: str | None
    states: Mapping[str, Mapping[str, torch.Tensor]] | None
    missing: tuple[str, ...] = ()  # ops of this space the source lacks: they keep their seeded init

    def record(self) -> dict[str, Any]:
        """summary.json's ``init_from``."""
        return {"path": str(self.path), "params_digest": self.source_digest}


INIT_EXPECTED = "train.init_from: expected a run directory with checkpoint.pt (or a checkpoint file), found"


def read_init_from(given: str, graph: SupernetGraph, read: bool) -> InitFrom:
    """``train.init_from``: the checkpoint of a run directory (its ``checkpoint.pt``) or a checkpoint
    file, its op states checked against ``graph`` (the shapes of every parameter and buffer of each
    op both have, from a meta build) and kept without their optimizer state. With ``read`` false
    (the run resumes) only where it is and the source's digest. Raises :class:`ConfigError`."""
    where = Path(given).expanduser().absolute()
    path = where if where.is_file() else where / CHECKPOINT_NAME
    digest = summary_digest(path)
    if not read:
        return InitFrom(path, digest, None)
    if not where.exists():
        raise ConfigError(f"{INIT_EXPECTED} no such path: {where}")
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"{INIT_EXPECTED} one that cannot be read: {e}") from None
    if ckpt is None:
        raise ConfigError(f"{INIT_EXPECTED} a directory without one: {where}")
    shapes: dict[OpSpec, dict[str, tuple[int, ...]]] = {}  # per op spec (one meta build each)
    states, missing = {}, []
    for slot in graph.slots():
        source = ckpt.op_states.get(slot.op_id)
        if source is None:
            missing.append(slot.op_id)
            continue
        if slot.spec not in shapes:
            with torch.device("meta"):
                shapes[slot.spec] = weight_shapes(build_op(slot.spec, slot.op_id, 0, seeded=False))
        want, weights = shapes[slot.spec], weights_only(source)
        got = {key: tuple(t.shape) for key, t in weights.items()}
        if got != want:
            key = next(k for k in [*want, *got] if want.get(k) != got.get(k))  # the first in the op's order
            found = f"shape {got[key]}" if key in got else "none"
            expected = f"{key} of shape {want[key]}" if key in want else f"no {key}"
            raise ConfigError(f"train.init_from: op {slot.op_id!r} of {path}: expected {expected} (the space trained "
                              f"here), found {found}; init_from takes a run of the same space (space.* settings)")
        states[slot.op_id] = weights
    if not states:
        raise ConfigError(f"train.init_from: expected a run of this space, found a checkpoint with none of its "
                          f"{len(missing)} ops: {path} (op ids there: {', '.join(sorted(ckpt.op_states)[:4])}, ...)")
    return InitFrom(path, digest, states, tuple(missing))


def summary_digest(checkpoint: Path) -> str | None:
    """The ``params_digest`` of the run whose ``checkpoint.pt`` this is, from its summary.json
    (``None``: another file, no summary, or none there)."""
    summary = checkpoint.with_name(SUMMARY_NAME)
    if checkpoint.name != CHECKPOINT_NAME or not summary.is_file():
        return None
    try:
        digest = json.loads(summary.read_text()).get("params_digest")
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None
