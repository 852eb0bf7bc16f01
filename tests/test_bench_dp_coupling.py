"""bench/dp_coupling.py: its paired per-step ratios (pure arithmetic) and the patch it applies."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dp_coupling import ALIGN_PATCH, paired  # noqa: E402


def test_paired_is_the_median_over_steps_of_the_ratio_to_the_baselines_mean():
    a = {0: {"forward": 3.0, "backward": 4.0}, 1: {"forward": 2.0, "backward": 6.0}, 2: {"forward": 9.0}}
    b1 = {0: {"forward": 1.0, "backward": 2.0}, 1: {"forward": 2.0, "backward": 2.0}, 2: {"forward": 3.0}}
    b2 = {0: {"forward": 3.0, "backward": 2.0}, 1: {"forward": 2.0, "backward": 4.0}, 2: {"forward": 3.0}}
    got = paired(a, b1, b2)
    assert got["forward"] == pytest.approx(1.5)  # ratios 3/2, 2/2, 9/3: median 1.5
    assert got["backward"] == pytest.approx(2.0)  # ratios 4/2, 6/3: steps 0-1 only (step 2 has no backward)
    assert got["optimizer"] is None and got["reduce"] is None


def test_paired_skips_steps_a_baseline_did_not_trace():
    a = {0: {"forward": 2.0}, 5: {"forward": 100.0}}
    b = {0: {"forward": 1.0}}
    assert paired(a, b)["forward"] == pytest.approx(2.0)


def test_the_alignment_patch_still_applies_to_the_app():
    """--aligned patches search/training.py in a scratch worktree: a change there must keep the patch applying."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "apply", "--check", str(ALIGN_PATCH)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
