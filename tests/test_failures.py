"""A failing rank makes the whole job exit promptly with a message naming rank, step and action.
(A rank killed mid-step, with torchrun restarting the job: tests/test_cli.py.)"""
from __future__ import annotations

import pytest

from distributed import Scenario, spawn

pytestmark = pytest.mark.dist

SC = [Scenario("transformer", "1f1b", steps=4)]


def test_raising_rank_stops_every_rank_with_a_named_failure() -> None:
    _, procs, seconds = spawn(3, SC, timeout_s=120, env_extra={"PIPENAS_FAULT": "1:2:1B1:raise"}, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    failed = procs[1].stderr
    assert "rank 1 (stage 1) failed at step 2 during 1B1" in failed
    assert "[1B1]" in failed, "the schedule grid with the failing action marked is missing"
    for r in (0, 2):
        assert "root cause: rank 1 failed at step 2 during 1B1" in procs[r].stderr, procs[r].stderr[-2000:]
    assert seconds < 100


@pytest.mark.parametrize("ahead", [True, False], ids=["planned-ahead", "planned-when-needed"])
def test_ranks_that_disagree_on_the_subnet_stop_before_anything_moves(ahead: bool) -> None:
    # rank 1 samples another arch stream from step 2 on: with plans made ahead the check posted
    # during step 1 fails when step 2 starts, before the moves made ahead settle; planned when
    # needed, the check of the fresh plan fails; either way in the plan phase of step 2, on every rank
    sc = [Scenario("transformer", "1f1b", steps=4, diverge_rank=1, diverge_at=2, plan_ahead=ahead)]
    _, procs, seconds = spawn(2, sc, timeout_s=120, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    for r, p in enumerate(procs):
        assert p.returncode != 0
        assert f"rank {r} (stage {r}) failed at step 2 during plan" in p.stderr, p.stderr[-2000:]
        assert "ranks disagree on the segment's subnets, partitions or schedule" in p.stderr, p.stderr[-2000:]
    assert seconds < 100


def test_a_failing_rank_stops_a_cross_subnet_run_naming_step_and_action() -> None:
    """Several subnets in flight: the report names the rank, the step (the subnet) and the action,
    with the excerpt of the segment's grid around it; the other ranks quote it and exit."""
    sc = [Scenario("transformer", "1f1b", steps=4, segment=4,
                   extra={"window": 3, "shared_ops": "delayed", "shared_delay": 1})]
    _, procs, seconds = spawn(2, sc, timeout_s=120, env_extra={"PIPENAS_FAULT": "1:2:1B1:raise"}, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "rank 1 (stage 1) failed at step 2 during 1B1" in procs[1].stderr, procs[1].stderr[-2000:]
    assert "[1B1@2]" in procs[1].stderr, "the grid excerpt with the failing action marked is missing"
    assert "root cause: rank 1 failed at step 2 during 1B1" in procs[0].stderr, procs[0].stderr[-2000:]
    assert seconds < 100
