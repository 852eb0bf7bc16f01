"""No silent divergence, and the app's other guards: a non-finite loss stops the run (or is
skipped), a non-finite evaluation is never the best, constraints no arch meets fail before
anything is written, and a corrupt latest checkpoint falls back to the one before."""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
from pathlib import Path

import pytest

import pipeline.reference
from pipeline import EvalResult, params_digest
from search.app import NonFiniteLoss, run
from search.checkpoint import load_checkpoint
from search.evolution import SearchError, SubnetCost
from supernet import Arch
from supernet.spaces import conv
from tests.cli_driver import torchrun_search
from tests.test_app import ROOT, TINY, make_cfg, read_metrics

DIVERGING = ["~space", "+space._target_=tests.diverging_space.build", "+space.at_step=7", "+space.at_microbatch=1"]
ARCH_JSON = '{"l0": "blowup", "l1": "'  # the step's arch, as the message prints it


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # so that `tests.diverging_space` imports


def test_nonfinite_loss_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLoss) as e:
        run(make_cfg(*DIVERGING), output_dir=tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"step 7: the loss is nan at micro-batch 1 of arch {ARCH_JSON}") and "\n" not in msg
    assert "lower train.optimizer.lr or add train.warmup_steps" in msg and "train.nonfinite=skip" in msg
    assert f"the last good checkpoint is {tmp_path / 'checkpoint.pt'} (step 5)" in msg
    assert e.value.step == 7
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(8)) and metrics[-1]["loss"] is None
    assert metrics[-1]["nonfinite"] == "stop" and all(m["loss"] > 0 for m in metrics[:-1])
    assert load_checkpoint(tmp_path / "checkpoint.pt").step == 5 and not (tmp_path / "summary.json").exists()


def test_skip_updates_nothing_for_that_step_and_counts_it(tmp_path: Path) -> None:
    summary = run(make_cfg(*DIVERGING, "train.nonfinite=skip"), output_dir=tmp_path)
    metrics = read_metrics(tmp_path)
    assert summary["nonfinite_steps_skipped"] == 1 and metrics[7]["nonfinite"] == "skip"
    assert [m["step"] for m in metrics if m["loss"] is None] == [7]  # later steps are finite again
    assert summary["best"] is not None and not summary["best"]["nonfinite"] and summary["final_loss"] is not None


def test_nonfinite_evaluation_ranks_last_and_is_never_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pipeline.reference.ReferenceEngine.evaluate
    poisoned = Arch({"layer00": "k5e6", "layer01": "k5e6"})

    def evaluate(self, arch, batches, calib_batches=()):
        ev = real(self, arch, batches, calib_batches)
        return EvalResult(math.nan, ev.total, ev.total) if arch == poisoned else ev  # "100 %" but NaN

    monkeypatch.setattr(pipeline.reference.ReferenceEngine, "evaluate", evaluate)
    summary = run(make_cfg("search.top_k=8", "search.seed_archs=[{layer00:k5e6,layer01:k5e6}]"), output_dir=tmp_path)
    top = summary["top_k"]
    assert top[-1]["arch"] == dict(poisoned) and top[-1]["nonfinite"] and top[-1]["val_loss"] is None
    assert summary["best"] == top[0] and not any(t["nonfinite"] for t in top[:-1])
    log = [json.loads(line) for line in (tmp_path / "search-evolution.jsonl").read_text().splitlines()]
    assert [e["nonfinite"] for e in log].count(True) == 1 and log[0]["arch"] == dict(poisoned)


def test_constraints_no_arch_meets_fail_before_anything_is_written(tmp_path: Path) -> None:
    graph = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])
    cost = SubnetCost(graph, (1, 8, 8))
    space = graph.space()
    every = [Arch(zip(space.labels, vs)) for vs in itertools.product(*(c.values for c in space.choices))]
    arch, least = cost.cheapest(space, "params")
    assert least == min(cost.params(a) for a in every)  # the exhaustive minimum of the tiny space
    _, least_flops = cost.cheapest(space, "flops")
    assert least_flops == min(cost.flops(a) for a in every)
    out = tmp_path / "run"
    with pytest.raises(SearchError) as e:
        run(make_cfg(f"search.constraints.max_params={least - 1}"), output_dir=out)
    assert str(e.value).startswith(f"search.constraints.max_params: expected at least {least}, the fewest params")
    assert not out.exists()
    with pytest.raises(SearchError, match=f"search.constraints.max_flops: expected at least {least_flops}"):
        run(make_cfg(f"search.constraints.max_flops={least_flops - 1}"), output_dir=out)
    assert not out.exists()  # the CLI's one line and status 2: tests/test_cli.py


def test_corrupt_latest_checkpoint_resumes_from_the_one_before(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    first = run(make_cfg(), output_dir=tmp_path)
    latest, prev = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    assert load_checkpoint(prev).step == 10
    latest.write_bytes(b"not a checkpoint")  # e.g. a disk that lost the last write
    with caplog.at_level(logging.WARNING):
        again = run(make_cfg(), output_dir=tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "cannot read the latest checkpoint" in r.getMessage())
    assert str(latest) in warning and str(prev) in warning and "(step 10)" in warning
    assert again["resumed_from_step"] == 10 and again["params_digest"] == first["params_digest"]
    assert load_checkpoint(latest).step == 12 and load_checkpoint(prev).step == 10  # the good one was kept
    assert params_digest(load_checkpoint(latest).op_states) == first["params_digest"]
    os.remove(latest)  # a crash between keeping the previous and renaming the new one
    with caplog.at_level(logging.WARNING):
        third = run(make_cfg(), output_dir=tmp_path)
    assert third["resumed_from_step"] == 10 and any("no latest checkpoint" in r.getMessage() for r in caplog.records)


@pytest.mark.dist
def test_torchrun_two_stages_stop_at_the_nonfinite_step(tmp_path: Path) -> None:
    p = torchrun_search([*DIVERGING, *TINY, "pipeline.timeout_s=60", "pipeline.stages=2",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if "error: step 7: the loss is nan" in line]
    assert len(errors) == 1 and "micro-batch 1" in errors[0], p.stderr[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 8 and metrics[-1]["nonfinite"] == "stop"
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").step == 5
    assert not (tmp_path / "run" / "summary.json").exists()
