"""Cross-subnet pipelining from the command line: the app under torchrun equals one process.

``pipeline.window`` > 1 keeps several subnets in flight; with ``shared_ops=exact`` the run is
sequential training (the default run's digest), with ``delayed`` the one-process run of the same
settings computes the same bits. Run directories, checkpoints at boundaries (nothing in flight
is lost: the resumed run ends with the same digest) and the summary's record of the settings.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.app import run
from tests.cli_driver import torchrun_search
from tests.test_app import ROOT, TINY, TINY_CONV, make_cfg
from tests.test_divergence import DIVERGING

DELAYED = ["pipeline.window=4", "pipeline.shared_ops=delayed", "pipeline.shared_delay=1", "sampler=fair"]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # so that `tests.diverging_space` imports


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {name: run(make_cfg(*extra), output_dir=tmp_path_factory.mktemp(name))
            for name, extra in {"flushed": [], "exact": ["pipeline.window=4"], "delayed": DELAYED}.items()}


def test_one_process_exact_window_is_sequential_and_delayed_is_recorded(one_process: dict) -> None:
    assert one_process["exact"]["params_digest"] == one_process["flushed"]["params_digest"]
    assert one_process["delayed"]["params_digest"] != one_process["flushed"]["params_digest"]
    assert one_process["delayed"]["pipeline"] == {"window": 4, "shared_ops": "delayed", "shared_delay": 1,
                                                  "shared_delays": {}, "delay_compensation": ["predict", 1.0]}
    assert one_process["flushed"]["pipeline"] == {"window": 1, "shared_ops": "exact", "shared_delay": None,
                                                  "shared_delays": None, "delay_compensation": None}


def test_delayed_reads_change_the_train_digest() -> None:
    """A checkpoint of an exact run does not resume a delayed one (they train different weights)."""
    from search.config import train_digest

    assert train_digest(make_cfg()) == train_digest(make_cfg("pipeline.window=4"))  # window alone changes nothing
    assert train_digest(make_cfg()) != train_digest(make_cfg(*DELAYED))
    assert train_digest(make_cfg(*DELAYED)) != train_digest(make_cfg(*DELAYED[:2], "pipeline.shared_delay=2", "sampler=fair"))
    # the delay's compensation (rule and coefficient) is part of what a delayed run trains; an
    # exact run ignores it, so its digest does not change
    digests = {train_digest(make_cfg(*DELAYED, f"pipeline.delay_compensation={rule}",
                                     f"pipeline.delay_compensation_coef={coef}"))
               for rule, coef in (("predict", 1.0), ("predict", 0.5), ("none", 1.0), ("dc", 1.0))}
    assert len(digests) == 4 and train_digest(make_cfg(*DELAYED)) in digests
    assert train_digest(make_cfg("pipeline.delay_compensation=none")) == train_digest(make_cfg())
    # an op's own delay too (pipeline.shared_delays); none given leaves older delayed digests as they were
    own = {train_digest(make_cfg(*DELAYED, f"pipeline.shared_delays={d}")) for d in ("{head:0}", "{head:2}", "{}")}
    assert len(own) == 3 and train_digest(make_cfg(*DELAYED)) in own
    assert train_digest(make_cfg("pipeline.shared_delays={head:0}")) == train_digest(make_cfg())


@pytest.mark.dist
def test_torchrun_cross_subnet_matches_one_process_and_resumes(one_process: dict, tmp_path: Path) -> None:
    args = [*TINY_CONV, *TINY, *DELAYED, "pipeline.timeout_s=60", "pipeline.trace_steps=[6]", "pipeline.stages=2",
            f"hydra.run.dir={tmp_path}/run"]
    first = torchrun_search(args, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["params_digest"] == one_process["delayed"]["params_digest"]
    assert summary["top_k"] == one_process["delayed"]["top_k"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(12))
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert trace, "the traced step's spans are written"

    # resume from the checkpoint at step 10 (as if interrupted after it): the same weights at the end
    (tmp_path / "run" / "checkpoint.pt").replace(tmp_path / "run" / "checkpoint.pt.final")
    (tmp_path / "run" / "checkpoint.prev.pt").replace(tmp_path / "run" / "checkpoint.pt")
    again = torchrun_search(args, tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 10
    assert resumed["params_digest"] == one_process["delayed"]["params_digest"]


def test_nonfinite_loss_in_a_segment_stops_at_that_step(tmp_path: Path) -> None:
    """Subnets after the diverging one ran in its segment, but the run stops at its step as the
    flushed run does: its metrics end there and the last good checkpoint stays."""
    from search.app import NonFiniteLoss
    from search.checkpoint import load_checkpoint

    with pytest.raises(NonFiniteLoss) as e:
        run(make_cfg(*DIVERGING, *DELAYED[:3]), output_dir=tmp_path / "stop")
    assert str(e.value).startswith("step 7: the loss is nan at micro-batch 1") and e.value.step == 7
    metrics = [json.loads(x) for x in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(8)) and metrics[-1]["nonfinite"] == "stop"
    assert load_checkpoint(tmp_path / "stop" / "checkpoint.pt").step == 5

    skipped = run(make_cfg(*DIVERGING, *DELAYED[:3], "train.nonfinite=skip"), output_dir=tmp_path / "skip")
    assert skipped["nonfinite_steps_skipped"] == 1 and skipped["final_loss"] is not None
