"""Retrain / fine-tune from inherited weights: ``train.init_from=<run dir>`` (issue 24).

Run A trains the tiny supernet; run B retrains A's best arch alone (``sampler=fixed search=none``)
starting from A's weights and buffers with a fresh optimizer. Checked against a reference engine
driven by hand (A's weights loaded without their optimizer state), against a run without
``init_from``, through the command line for bad input, on resume, with a device budget, and under
torchrun (P = 2 equals one process).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeline import params_digest
from pipeline.memory.state import weights_only
from pipeline.reference import ReferenceEngine
from search.app import prepare, run
from search.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from search.config import ConfigError, train_digest
from tests.cli_driver import Case, run_cases, torchrun_search
from tests.test_app import TINY, TINY_CONV, make_cfg, read_metrics

EXPECTED = "train.init_from: expected a run directory with checkpoint.pt (or a checkpoint file), found"


def fixed(arch: dict[str, str]) -> list[str]:
    """Overrides that retrain ``arch`` alone and search nothing."""
    return ["sampler=fixed", "sampler.arch={" + ", ".join(f"{k}: {v}" for k, v in arch.items()) + "}", "search=none"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A (the supernet), B (A's best retrained from A's weights) and C (the same without init_from)."""
    root = tmp_path_factory.mktemp("init_from")
    a = run(make_cfg(), output_dir=root / "A")
    arch = a["best"]["arch"]
    b = run(make_cfg(*fixed(arch), f"train.init_from={root / 'A'}"), output_dir=root / "B")
    c = run(make_cfg(*fixed(arch)), output_dir=root / "C")
    return {"root": root, "arch": arch, "A": a, "B": b, "C": c}


def by_hand(runs: dict, states: dict, steps: int) -> tuple[list[float], str]:
    """B's training done by a reference engine whose ops are loaded with ``states``: the losses
    and the params digest after ``steps`` steps."""
    p = prepare(make_cfg(*fixed(runs["arch"])), output_dir=runs["root"] / "by-hand")
    t = p.rc.train
    engine = ReferenceEngine(p.graph, p.rc.seed, t.optimizer, t.microbatches, t.schedule(), "cpu")
    engine.load_op_states(states)
    arch = p.graph.space().validate(runs["arch"])
    losses = [engine.train_step(k, arch, *p.data.train_batch(k, t.batch_size)).loss for k in range(steps)]
    digest = params_digest(engine.op_states())
    engine.close()
    return losses, digest


def test_retrain_starts_from_the_source_weights_with_a_fresh_optimizer(runs: dict) -> None:
    root, b = runs["root"], runs["B"]
    source = load_checkpoint(root / "A" / "checkpoint.pt").op_states
    assert any(k.startswith("optim/") for s in source.values() for k in s)  # A's momentum is in its checkpoint
    first = read_metrics(root / "B")[0]["loss"]
    losses, digest = by_hand(runs, {op: weights_only(s) for op, s in source.items()}, 12)
    assert losses[0] == first  # B's first step saw A's weights ...
    assert read_metrics(root / "C")[0]["loss"] != first  # ... not the seeded init
    assert digest == b["params_digest"] != runs["C"]["params_digest"]
    _, with_momentum = by_hand(runs, dict(source), 12)  # A's optimizer state carried over: other weights
    assert with_momentum != b["params_digest"]
    assert b["init_from"] == {"path": str(root / "A" / "checkpoint.pt"), "params_digest": runs["A"]["params_digest"]}
    assert runs["C"]["init_from"] is None and b["trained_arch"] == runs["arch"] and b["best"] is not None
    saved = load_checkpoint(root / "B" / "checkpoint.pt")
    assert saved.train_config["train"]["init_from"] == str(root / "A")  # part of B's train digest


def test_init_from_is_in_the_train_digest_when_set() -> None:
    """Unset, it leaves the digest as before it was a field (checkpoints of older runs resume)."""
    before = OmegaConf.to_container(make_cfg(), resolve=True)
    del before["train"]["init_from"]  # a config from before the field
    assert train_digest(make_cfg()) == train_digest(before)
    assert train_digest(make_cfg("train.init_from=runs/x")) not in (train_digest(make_cfg()),
                                                                  train_digest(make_cfg("train.init_from=runs/y")))


def test_a_checkpoint_file_and_a_device_budget_give_the_same_weights(runs: dict) -> None:
    """A path to the file itself; the virtual store adopts weights only as the resident one does."""
    root = runs["root"]
    got = run(make_cfg(*fixed(runs["arch"]), f"train.init_from={root / 'A' / 'checkpoint.pt'}",
                       "memory.device_budget_bytes=1000000"), output_dir=root / "file-budget")
    assert got["params_digest"] == runs["B"]["params_digest"]
    assert got["init_from"]["path"] == str(root / "A" / "checkpoint.pt")


def test_ops_the_source_lacks_keep_their_seeded_init(runs: dict, caplog: pytest.LogCaptureFixture) -> None:
    root = runs["root"]
    more = ["space.kernels=[3,5,7]", f"train.init_from={root / 'A'}"]  # k7 candidates: not in A
    p = prepare(make_cfg(*more), output_dir=root / "more")
    assert p.init.missing == tuple(s.op_id for s in p.graph.slots() if s.op_id.endswith(("k7e3", "k7e6")))
    assert set(p.init.states) == {s.op_id for s in p.graph.slots()} - set(p.init.missing)
    assert all(not k.startswith("optim/") for s in p.init.states.values() for k in s)
    with caplog.at_level(logging.INFO, logger="search.app"):
        run(make_cfg(*more, *fixed({"layer00": "k7e3", "layer01": "k3e3"}), "train.steps=2", "train.warmup_steps=0"),
            output_dir=root / "more")
    assert "train.init_from: 4 ops not in it keep their seeded init: layer00/k7e3, layer00/k7e6, layer01/k7e3" in \
        caplog.text


def test_resume_ignores_init_from(runs: dict, tmp_path: Path) -> None:
    """A run stopped after step 10 resumes from its own checkpoint (the source, gone meanwhile, is
    not read again) and ends with the uninterrupted run's weights."""
    source = tmp_path / "source"
    shutil.copytree(runs["root"] / "A", source)
    cfg = make_cfg(*fixed(runs["arch"]), f"train.init_from={source}")
    first = run(cfg, output_dir=tmp_path / "run")
    assert first["params_digest"] == runs["B"]["params_digest"]
    shutil.rmtree(source)
    (tmp_path / "run" / "checkpoint.prev.pt").replace(tmp_path / "run" / "checkpoint.pt")  # as if stopped at 10
    again = run(cfg, output_dir=tmp_path / "run")
    assert again["resumed_from_step"] == 10 and again["params_digest"] == first["params_digest"]
    assert again["init_from"] == {"path": str(source / "checkpoint.pt"), "params_digest": None}
    with pytest.raises(ConfigError, match="found no such path"):  # afresh, the source must be there
        prepare(make_cfg(*fixed(runs["arch"]), f"train.init_from={source}"), output_dir=tmp_path / "afresh")


def test_bad_init_from_is_one_line_and_writes_nothing(runs: dict, tmp_path: Path) -> None:
    a = runs["root"] / "A"
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    save_checkpoint(tmp_path / "foreign.pt", Checkpoint(0, {"elsewhere/op": {"param/w": torch.zeros(1)}}, {}, "t", "c"))
    wider = ["space.layers=2", "space.channels=[8,8]", "space.downsample_at=[1]"]  # other widths than A's
    cases = {
        "wider": ([*wider, *TINY, f"train.init_from={a}"],
                  f"error: train.init_from: op 'stem' of {a / 'checkpoint.pt'}: expected param/conv.weight of shape "
                  "(8, 1, 3, 3) (the space trained here), found shape (4, 1, 3, 3); init_from takes a run of the same "
                  "space (space.* settings)"),
        "missing": ([*TINY_CONV, *TINY, f"train.init_from={tmp_path / 'nope'}"],
                    f"error: {EXPECTED} no such path: {tmp_path / 'nope'}"),
        "empty": ([*TINY_CONV, *TINY, f"train.init_from={tmp_path / 'empty'}"],
                  f"error: {EXPECTED} a directory without one: {tmp_path / 'empty'}"),
        "junk": ([*TINY_CONV, *TINY, f"train.init_from={tmp_path / 'junk.pt'}"],
                 f"error: {EXPECTED} one that cannot be read: checkpoint {tmp_path / 'junk.pt'}: expected a file "
                 "written by torch.save"),
        "foreign": ([*TINY_CONV, *TINY, f"train.init_from={tmp_path / 'foreign.pt'}"],
                    "error: train.init_from: expected a run of this space, found a checkpoint with none of its 11 ops: "
                    f"{tmp_path / 'foreign.pt'} (op ids there: elsewhere/op, ...)"),
    }
    results = run_cases([Case([*args, f"hydra.run.dir={tmp_path / 'runs' / name}"], str(tmp_path))
                         for name, (args, _) in cases.items()])
    for (name, (_, want)), res in zip(cases.items(), results):
        assert res.status == 2, (name, res.stderr[-2000:])
        assert len(res.errors) == 1 and res.errors[0].startswith(want), (name, res.errors)
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.dist
def test_torchrun_with_init_from_equals_one_process(runs: dict, tmp_path: Path) -> None:
    args = [*TINY_CONV, *TINY, *fixed(runs["arch"]), f"train.init_from={runs['root'] / 'A'}", "pipeline.timeout_s=60",
            "pipeline.stages=2", f"hydra.run.dir={tmp_path / 'p2'}"]
    p = torchrun_search(args, tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["params_digest"] == runs["B"]["params_digest"]
    assert summary["init_from"] == runs["B"]["init_from"]
    assert read_metrics(tmp_path / "p2")[0]["loss"] == read_metrics(runs["root"] / "B")[0]["loss"]
