"""bench/trace_vs_plan.py: the per-kind breakdown of a traced step (pure arithmetic on hand-made spans)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trace_vs_plan import KINDS, breakdown, measured, predicted_breakdown  # noqa: E402
from pipeline.plan.schedule import build  # noqa: E402
from pipeline.plan.simulate import simulate  # noqa: E402
from pipeline.trace import Span  # noqa: E402


def _s(rank: int, name: str, cat: str, start: float, dur: float, step: int = 7) -> Span:
    return Span(rank, step, name, cat, start, dur)


# One step on two ranks (seconds). Rank 0: plan, a forward holding its send, a backward holding
# its receive wait, an optimizer holding a reduce; a background migrate-ahead span that partially
# overlaps the backward (another thread's span: its time must not count twice). Rank 1: a forward
# holding its receive wait, a backward holding its send, a gap before the optimizer.
SPANS = [
    _s(0, "plan", "plan", 0.0, 1.0),
    _s(0, "0F0", "forward", 2.0, 4.0),
    _s(0, "send 0F0", "send", 5.0, 1.0),
    _s(0, "0B0", "backward", 6.0, 6.0),
    _s(0, "recv 0B0", "recv-wait", 6.0, 3.0),
    _s(0, "settle moves", "migrate-ahead", 11.0, 2.0),
    _s(0, "optimizer", "optimizer", 13.0, 2.0),
    _s(0, "reduce", "reduce", 13.5, 0.5),
    _s(1, "1F0", "forward", 1.0, 7.0),
    _s(1, "recv 1F0", "recv-wait", 1.0, 5.0),
    _s(1, "1B0", "backward", 8.0, 3.0),
    _s(1, "send 1B0", "send", 10.0, 1.0),
    _s(1, "optimizer", "optimizer", 12.0, 1.0),
]


def test_breakdown_kinds_sum_to_the_wall_time_and_rest_is_uncovered() -> None:
    m = measured(SPANS)
    r0, r1 = m[7][0], m[7][1]
    # a single traced step: the cycle is the rank's own extent
    assert r0["cycle"] == pytest.approx(15.0) and r1["cycle"] == pytest.approx(12.0)
    assert not r0["full"] and not r1["full"]
    for r in (r0, r1):
        assert sum(r[k] for k in KINDS) == pytest.approx(r["cycle"])
    # rank 0: the forward minus its send, the backward minus its wait and the later (innermost)
    # migrate-ahead span, the optimizer minus its reduce; uncovered: 1-2
    assert r0["plan"] == pytest.approx(1.0)
    assert r0["forward"] == pytest.approx(3.0) and r0["send"] == pytest.approx(1.0)
    assert r0["recv_wait"] == pytest.approx(3.0) and r0["backward"] == pytest.approx(2.0)
    assert r0["migrate"] == pytest.approx(2.0)
    assert r0["optimizer"] == pytest.approx(1.5) and r0["reduce"] == pytest.approx(0.5) and r0["other"] == 0.0
    assert r0["rest"] == pytest.approx(1.0)
    # rank 1 (starts at 1.0): uncovered 11-12 only
    assert r1["recv_wait"] == pytest.approx(5.0) and r1["forward"] == pytest.approx(2.0)
    assert r1["backward"] == pytest.approx(2.0) and r1["send"] == pytest.approx(1.0)
    assert r1["optimizer"] == pytest.approx(1.0) and r1["rest"] == pytest.approx(1.0)
    # the schedule's extent: the first forward's start to the last backward's end over both ranks
    assert r0["schedule"] == r1["schedule"] == pytest.approx(11.0)


def test_cycle_runs_to_the_next_traced_step() -> None:
    nxt = [_s(0, "plan", "plan", 20.0, 1.0, step=8), _s(1, "1F0", "forward", 19.0, 1.0, step=8)]
    m = measured(SPANS + nxt)
    assert m[7][0]["cycle"] == pytest.approx(20.0) and m[7][0]["full"]
    assert m[7][0]["rest"] == pytest.approx(1.0 + 5.0)  # 1-2 and 15-20
    assert m[7][1]["cycle"] == pytest.approx(18.0) and m[7][1]["rest"] == pytest.approx(1.0 + 6.0)


def test_breakdown_of_a_window_clips_spans() -> None:
    out = breakdown([_s(0, "0F0", "forward", 0.0, 10.0), _s(0, "0F0", "forward", 0.0, 10.0)], 2.0, 5.0)
    assert out["forward"] == pytest.approx(3.0) and sum(out.values()) == pytest.approx(3.0)


def test_predicted_breakdown_sums_to_the_makespan() -> None:
    sched = build("1f1b", 2, 4)
    sim = simulate(sched, [1.0, 2.0], [2.0, 4.0], [0.5])
    rows = predicted_breakdown(sim)
    for stage, row in enumerate(rows):
        assert sum(row[k] for k in KINDS) == pytest.approx(sim.step_time)
        assert row["forward"] == pytest.approx(4 * [1.0, 2.0][stage])
        assert row["backward"] == pytest.approx(4 * [2.0, 4.0][stage])
    assert rows[1]["recv_wait"] >= 1.5  # the last stage waits for the first forward and its send


def test_predicted_breakdown_counts_priced_updates_and_their_reduction() -> None:
    from pipeline.plan.admission import SubnetWork, sequential

    sched = sequential(build("1f1b", 1, 2), [[frozenset({"a"})]])
    work = SubnetWork((frozenset({"a"}),), (1.0,), (2.0,), (), (3.0,))
    sim = simulate(sched, work=[work])
    (row,) = predicted_breakdown(sim, reduce=[2.5])
    assert row["forward"] == pytest.approx(2.0) and row["backward"] == pytest.approx(4.0)
    assert row["optimizer"] == pytest.approx(0.5) and row["reduce"] == pytest.approx(2.5)
    assert sum(row[k] for k in KINDS) == pytest.approx(sim.step_time) == pytest.approx(9.0)
