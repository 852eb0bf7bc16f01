"""Train-only runs (``search=none``), the fixed sampler's preset, search progress off a terminal,
and summaries of several searches in one run directory that do not erase each other."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

import search.scoring
from search.app import run
from search.scoring import Progress
from search.checkpoint import load_checkpoint
from search.config import ConfigError, load_config
from tests.cli_driver import Case, run_cases
from tests.test_app import TINY, TINY_CONV, make_cfg, read_metrics

FIXED = {"layer00": "k3e3", "layer01": "k5e6"}  # an arch of the tiny conv space
FIXED_ARGS = ["sampler=fixed", "sampler.arch={layer00: k3e3, layer01: k5e6}"]
SECTION = ("best", "top_k", "evaluated", "best_per_generation", "search_time_s")


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# -- config ------------------------------------------------------------------------------------

def test_the_fixed_preset_takes_its_arch_without_a_plus_and_needs_one() -> None:
    rc = load_config(make_cfg(*FIXED_ARGS, "search=none"))
    assert rc.sampler.name == "fixed" and rc.sampler.arch == FIXED and rc.search.algorithm == "none"
    assert rc.search.budget == 0
    with pytest.raises(ConfigError) as e:
        load_config(make_cfg("sampler=fixed"))
    assert str(e.value).startswith("sampler.arch: expected the arch the fixed sampler trains") and "\n" not in str(e.value)
    assert str(e.value).endswith("found null")


# -- search=none -------------------------------------------------------------------------------

def test_search_none_with_a_fixed_arch_trains_it_scores_it_and_a_later_search_agrees(tmp_path: Path) -> None:
    summary = run(make_cfg(*FIXED_ARGS, "search=none"), output_dir=tmp_path)
    assert [m["arch"] for m in read_metrics(tmp_path)] == [FIXED] * 12  # that arch, every step
    assert load_checkpoint(tmp_path / "checkpoint.pt").step == 12
    assert summary_of(tmp_path) == summary
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "tb") == [
        "checkpoint.prev.pt", "checkpoint.pt", "metrics.csv", "metrics.jsonl", "summary.json"]  # no search-*.jsonl
    assert summary["trained_arch"] == FIXED and summary["best"]["arch"] == FIXED and summary["top_k"] == [summary["best"]]
    assert summary["search"]["algorithm"] == "none" and summary["search"]["evaluated"] == 1
    assert "no search ran" in summary["search"]["note"] and summary["searches"] == {}
    assert 0 <= summary["best"]["val_accuracy"] <= 1 and summary["best"]["params"] > 0

    # a search of the same weights scores that arch alike (the same evaluation: BN recalibrated)
    searched = run(make_cfg(*FIXED_ARGS, "search.top_k=8", "search.seed_archs=[{layer00: k3e3, layer01: k5e6}]"),
                   output_dir=tmp_path)
    assert searched["resumed_from_step"] == 12 and searched["params_digest"] == summary["params_digest"]
    assert next(t for t in searched["top_k"] if t["arch"] == FIXED) == summary["best"]
    assert list(summary_of(tmp_path)["searches"]) == ["evolution"]


def test_search_none_with_a_sampler_of_many_archs_scores_nothing(tmp_path: Path) -> None:
    summary = run(make_cfg("search=none"), output_dir=tmp_path)
    assert len({json.dumps(m["arch"], sort_keys=True) for m in read_metrics(tmp_path)}) > 1
    assert load_checkpoint(tmp_path / "checkpoint.pt").step == 12
    assert summary["best"] is None and summary["top_k"] == [] and summary["trained_arch"] is None
    assert summary["search"]["evaluated"] == 0 and "no search ran" in summary["search"]["note"]
    assert summary["final_loss"] == read_metrics(tmp_path)[-1]["loss"] and summary["params_digest"]


# -- summaries of several searches ------------------------------------------------------------

def test_evolution_then_random_in_one_directory_keep_both(tmp_path: Path) -> None:
    evolution = run(make_cfg(), output_dir=tmp_path)
    assert list(evolution["searches"]) == ["evolution"]
    section = {"best": evolution["best"], "top_k": evolution["top_k"], "evaluated": 8,
               "best_per_generation": evolution["search"]["best_per_generation"],
               "search_time_s": evolution["search_time_s"]}
    assert evolution["searches"]["evolution"] == section

    baseline = run(make_cfg("search=random"), output_dir=tmp_path)  # resumes, only searches
    saved = summary_of(tmp_path)
    assert saved == baseline and saved["search"]["algorithm"] == "random"  # the top level: the run just made
    assert saved["best"] == saved["searches"]["random"]["best"] and saved["top_k"] == saved["searches"]["random"]["top_k"]
    assert saved["searches"]["evolution"] == section and set(saved["searches"]["random"]) == set(SECTION)
    assert {p.name for p in tmp_path.glob("search-*.jsonl")} == {"search-evolution.jsonl", "search-random.jsonl"}

    # a train-only rerun keeps them; a summary from before `searches` gives its one search
    assert run(make_cfg("search=none"), output_dir=tmp_path)["searches"] == saved["searches"]
    old = {k: v for k, v in baseline.items() if k != "searches"}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    again = run(make_cfg(), output_dir=tmp_path)
    assert list(again["searches"]) == ["evolution", "random"]
    assert again["searches"]["random"] == baseline["searches"]["random"]
    assert again["searches"]["evolution"]["top_k"] == section["top_k"]  # the same search, run again

    # other weights (started afresh over the directory): the old searches go
    other = run(make_cfg("train.optimizer.lr=0.2", "resume=false", "search=random"), output_dir=tmp_path)
    assert other["params_digest"] != baseline["params_digest"] and list(other["searches"]) == ["random"]


# -- progress off a terminal ------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_at_most_one_per_interval_and_the_last(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logger = logging.LoggerAdapter(logging.getLogger("test.progress"), {})
    progress = Progress("search (evolution)", 10, logger, clock)
    with caplog.at_level(logging.INFO, "test.progress"):
        for i, score in enumerate([0.1, 0.3, float("-inf"), 0.2, 0.5, 0.4, 0.1, 0.2, 0.6, 0.3]):
            clock.now += 1.5  # an arch every 1.5 s: a line every 4th arch (6 s >= 5 s)
            progress.update(score)
        progress.finish()
        progress.finish()  # nothing new: no line
    assert search.scoring.PROGRESS_EVERY_S == 5.0
    assert [r.getMessage() for r in caplog.records] == [
        "search (evolution): 4/10 archs scored, best val accuracy 0.3000, 0.7 archs/s",
        "search (evolution): 8/10 archs scored, best val accuracy 0.5000, 0.7 archs/s",
        "search (evolution): 10/10 archs scored, best val accuracy 0.6000, 0.7 archs/s",
    ]


@pytest.mark.parametrize(("every_s", "counts"), [(0.0, list(range(1, 9))), (1e9, [8])])
def test_the_search_logs_progress_off_a_terminal(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch, every_s: float,
                                                 counts: list[int]) -> None:
    monkeypatch.setattr(search.scoring, "PROGRESS_EVERY_S", every_s)
    with caplog.at_level(logging.INFO, "search.app"):
        summary = run(make_cfg(), output_dir=tmp_path)
    lines = [m for r in caplog.records if (m := r.getMessage()).startswith("[rank 0] search (evolution): ")]
    found = [re.fullmatch(r"\[rank 0\] search \(evolution\): (\d+)/8 archs scored, best val accuracy ([\d.]+), "
                          r"[\d.]+ archs/s", m) for m in lines]
    assert all(found), lines
    assert [int(m.group(1)) for m in found] == counts
    scored = [json.loads(line)["val_accuracy"] for line in (tmp_path / "search-evolution.jsonl").read_text().splitlines()]
    assert [m.group(2) for m in found] == [f"{max(scored[:n]):.4f}" for n in counts]
    assert found[-1].group(2) == f"{summary['best']['val_accuracy']:.4f}"


# -- the command line -------------------------------------------------------------------------

def test_the_command_line(tmp_path: Path) -> None:
    tiny = [*TINY_CONV, *TINY]
    cases = {
        "fixed": [*tiny, *FIXED_ARGS, "search=none", f"hydra.run.dir={tmp_path}/fixed"],
        "search-it": [*tiny, *FIXED_ARGS, f"hydra.run.dir={tmp_path}/fixed"],  # the same supernet, searched
        "uniform": [*tiny, "search=none", f"hydra.run.dir={tmp_path}/uniform"],
        "no-arch": [*tiny, "sampler=fixed", "search=none", f"hydra.run.dir={tmp_path}/rejected"],
    }
    results = dict(zip(cases, run_cases([Case(args, str(tmp_path)) for args in cases.values()])))

    def printed(name: str) -> list[str]:
        r = results[name]
        assert r.status == 0, r.stderr
        return [line for line in r.stdout.splitlines() if not re.match(r"\[\d{4}-\d\d-\d\d ", line)]

    fixed = summary_of(tmp_path / "fixed")
    assert fixed["search"]["algorithm"] == "evolution"  # the later search's
    trained = fixed["searches"]["evolution"]  # (its section; the train-only run's result is printed below)
    lines = printed("fixed")
    assert lines[0] == 'trained arch: {"layer00": "k3e3", "layer01": "k5e6"}'
    assert re.fullmatch(r"val accuracy: [01]\.\d{4} \(params \d+, flops \d+\)", lines[1]) and len(lines) == 3
    assert lines[2] == f"output dir: {tmp_path}/fixed"
    assert printed("search-it")[0] == f"best arch: {json.dumps(trained['best']['arch'], sort_keys=True)}"
    # off a terminal the search's progress is in the log: the last line at least, with the counts
    assert re.search(r"\[search\.app\]\[INFO\] - \[rank 0\] search \(evolution\): 8/8 archs scored, best val "
                     r"accuracy [\d.]+, [\d.]+ archs/s", results["search-it"].stdout), results["search-it"].stdout

    uniform = summary_of(tmp_path / "uniform")
    assert printed("uniform") == [
        f"trained: 12 steps, sampler uniform, final loss {uniform['final_loss']:.4f}; no search ran (search=none)",
        f"output dir: {tmp_path}/uniform"]

    r = results["no-arch"]
    assert r.status == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: sampler.arch: expected the arch the fixed sampler trains, a mapping label -> value "
        "(e.g. sampler.arch='{layer00: k3e3, layer01: k5e6, ...}'), found null"]
    assert not (tmp_path / "rejected").exists()
