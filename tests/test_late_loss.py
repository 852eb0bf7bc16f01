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
