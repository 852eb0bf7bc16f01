"""The pipelined engine's trace: for every traced step, every action of every rank's schedule
appears exactly once, in schedule order, and within a rank's track spans nest or are disjoint."""
from __future__ import annotations

import pytest

from distributed import Scenario, spawn
from pipeline.plan.schedule import build
from pipeline.trace import Span, check_trace

pytestmark = pytest.mark.dist


SCHEDULES = ("gpipe", "1f1b")


def test_every_action_appears_once_in_schedule_order() -> None:
    # both schedules in one spawn: process start-up dominates these runs
    scenarios = [Scenario("cell", schedule, steps=4, microbatches=4, trace_steps=(1, 3)) for schedule in SCHEDULES]
    results, _, _ = spawn(3, scenarios, timeout_s=180)
    for schedule, result in zip(SCHEDULES, results):
        spans = [Span(*row[:6], tuple(tuple(a) for a in row[6])) for row in result["spans"]]
        check_trace(spans)
        grid = build(schedule, 3, 4)
        for step in (1, 3):
            for rank in range(3):
                mine = sorted((s for s in spans if s.rank == rank and s.step == step
                               and s.cat in ("forward", "backward")), key=lambda s: s.start_s)
                assert [s.name for s in mine] == [str(a) for a in grid.actions[rank]], (schedule, step, rank)
            assert any(s.cat == "recv-wait" for s in spans if s.step == step), schedule
            assert any(s.cat == "optimizer" for s in spans if s.step == step), schedule
        assert {s.step for s in spans} == {1, 3}, schedule
