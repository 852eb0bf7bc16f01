"""bench/layouts.py's ceiling of a layout that synchronises once a step (pure arithmetic)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from layouts import synced_time  # noqa: E402


def test_synced_time_takes_the_slower_run_of_every_step_and_keeps_the_time_outside_steps():
    steps = [[1.0, 3.0, 2.0], [2.0, 1.0, 2.5]]
    # run 0: 6.0 s of steps in 7.0 s of training (1.0 s outside them); per step max: 2 + 3 + 2.5
    assert synced_time(7.0, steps, 0) == pytest.approx(1.0 + 7.5)
    assert synced_time(6.0, steps, 1) == pytest.approx(0.5 + 7.5)


def test_synced_time_is_the_run_itself_when_the_other_is_never_slower():
    steps = [[2.0, 2.0], [1.0, 2.0]]
    assert synced_time(5.0, steps, 0) == pytest.approx(5.0)


def test_synced_time_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError, match="as many steps"):
        synced_time(1.0, [[1.0], [1.0, 2.0]], 0)
