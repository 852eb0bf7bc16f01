"""Checkpoints round-trip, refuse other formats, and are written atomically."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from search import checkpoint as ck
from search.checkpoint import (Checkpoint, CheckpointError, atomic_write_text, load_checkpoint,
                               save_checkpoint)


def sample() -> Checkpoint:
    states = {"a/x": {"param/w": torch.arange(6.0).view(2, 3), "optim/0/momentum_buffer": torch.ones(2, 3)},
              "b": {"buffer/running_mean": torch.zeros(4), "param/bias": torch.tensor([1.5])}}
    sampler = {"kind": "fair", "seed": 3, "space": "abc", "consumed": 17}
    return Checkpoint(17, states, sampler, "t" * 64, "c" * 64)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run" / "checkpoint.pt"
    save_checkpoint(path, sample())
    got = load_checkpoint(path)
    want = sample()
    assert (got.step, got.sampler, got.train_digest, got.config_digest) == (
        want.step, want.sampler, want.train_digest, want.config_digest)
    assert got.op_states.keys() == want.op_states.keys()
    for op_id, state in want.op_states.items():
        assert got.op_states[op_id].keys() == state.keys()
        for k, t in state.items():
            assert torch.equal(got.op_states[op_id][k], t)
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]  # no temporary left


def test_missing_is_none_and_bad_files_are_refused(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "nothing.pt") is None
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="expected a file written by torch.save, found one torch cannot load"):
        load_checkpoint(junk)
    old = tmp_path / "old.pt"
    data = sample().to_dict()
    data["format_version"] = 0
    torch.save(data, old)
    with pytest.raises(CheckpointError, match="expected format version 1, found 0"):
        load_checkpoint(old)
    del data["step"]
    data["format_version"] = 1
    torch.save(data, old)
    with pytest.raises(CheckpointError, match="missing field 'step'"):
        load_checkpoint(old)


def test_a_failed_write_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new " * 1000)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    monkeypatch.undo()
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
