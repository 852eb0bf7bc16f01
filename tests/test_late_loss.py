"""bench/late_loss.py: a mode names the overrides its runs get (the delay's compensation a column)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import late_loss  # noqa: E402


def test_a_compensated_mode_adds_its_rule_and_coefficient() -> None:
    assert late_loss.mode_overrides("exact") == ["pipeline.shared_ops=exact"]
    assert late_loss.mode_overrides("delayed4") == late_loss.MODES["delayed4"]  # the config's default rule
    assert late_loss.mode_overrides("delayed1+none") == [*late_loss.MODES["delayed1"], "pipeline.delay_compensation=none"]
    assert late_loss.mode_overrides("delayed4+dc:64") == [*late_loss.MODES["delayed4"], "pipeline.delay_compensation=dc",
                                                          "pipeline.delay_compensation_coef=64"]


def test_live_scoring_is_one_generation_of_random_archs_or_none() -> None:
    assert late_loss.scoring(0) == ["search=none"]
    assert late_loss.scoring(24) == ["search=random", "search.population=24", "search.generations=1"]


def test_live_scores_are_means_over_every_scored_arch_and_none_when_one_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "search-random.jsonl"
    path.write_text('{"val_loss": 0.5, "val_accuracy": 0.75}\n{"val_loss": 1.5, "val_accuracy": 0.25}\n')
    assert late_loss.live_scores(path, 0) == {}
    assert late_loss.live_scores(path, 2) == {"live_val_loss": 1.0, "live_val_acc": 0.5}
    assert late_loss.live_scores(path, 3) == {"live_val_loss": None, "live_val_acc": None}
    path.write_text('{"val_loss": null, "val_accuracy": 0.1}\n')
    assert late_loss.live_scores(path, 1) == {"live_val_loss": None, "live_val_acc": None}


def test_a_ratio_is_a_delayed_run_over_exact_and_none_without_both() -> None:
    exact = {"late_loss": 0.5, "live_val_loss": None}
    assert late_loss.ratio({"late_loss": 0.75}, exact, "late_loss") == 1.5
    assert late_loss.ratio(exact, exact, "late_loss") is None
    assert late_loss.ratio({"late_loss": None}, exact, "late_loss") is None
    assert late_loss.ratio({"live_val_loss": 0.3}, exact, "live_val_loss") is None
    assert late_loss.ratio({"late_loss": 0.75}, {}, "late_loss") is None
