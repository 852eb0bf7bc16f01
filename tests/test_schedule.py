"""Schedules as data: builders, the validator, in-flight counts and the grid."""
from __future__ import annotations

import itertools
import re

import pytest

import pipeline.plan.schedule as schedule_module
from pipeline.plan.schedule import (
    Action, Schedule, ScheduleError, build, format_grid, forward_only, gpipe, in_flight, max_in_flight,
    one_f_one_b, validate,
)

SIZES = list(itertools.product(range(1, 7), range(1, 11)))


def _sched(rows: list[str], name: str = "hand", M: int | None = None, training: bool = True, **kw) -> Schedule:
    """A schedule from its rows as text (``kw``: the cross-subnet fields, ``num_subnets``, ``uses``, ...)."""
    actions = tuple(tuple(Action.parse(x) for x in row.split()) for row in rows)
    if M is None:
        M = 1 + max(a.microbatch for row in actions for a in row)
    return Schedule(name, len(actions), M, actions, training, **kw)


# ------------------------------------------------------------------------------ actions


@pytest.mark.parametrize("text", ["0F0", "1F0", "3B12", "10F7"])
def test_action_round_trip(text: str) -> None:
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["1F0@3", "0B2@1", "1U@2", "0U", "12U@40", "3F11@7"])
def test_subnet_action_round_trip(text: str) -> None:
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_subnet_action_fields() -> None:
    assert Action.parse("1F0@3") == Action(1, "F", 0, 3)
    assert Action.parse("1U@2") == Action(1, "U", 0, 2)
    assert Action.parse("0U") == Action(0, "U", 0, 0)
    assert Action.parse("2B1@0") == Action(2, "B", 1)  # subnet 0 prints without its suffix
    assert str(Action(2, "B", 1, 0)) == "2B1"
    for a in (Action(s, k, 0 if k == "U" else m, t) for s in range(3) for k in "FBU" for m in range(3) for t in range(3)):
        assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["1F0@", "1F0@-1", "1F0@x", "1U0", "1U0@2", "U@1", "1U@", "@1", "1F0@1@2", "1u@1"])
def test_subnet_action_parse_rejects(text: str) -> None:
    with pytest.raises(ScheduleError, match=r"'2F1@4'.*'<stage>U\[@<subnet>\]'"):
        Action.parse(text)


def test_subnet_action_rejects_bad_fields() -> None:
    with pytest.raises(ScheduleError, match="Action.subnet"):
        Action(0, "F", 0, -1)
    with pytest.raises(ScheduleError, match="an update .'U'. covers every micro-batch"):
        Action(0, "U", 1, 0)


def test_action_fields() -> None:
    assert Action.parse("1F0") == Action(1, "F", 0)
    assert str(Action(2, "B", 5)) == "2B5"


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "1f0", "-1F0", "1F0x", 3])
def test_action_parse_rejects(text: object) -> None:
    with pytest.raises(ScheduleError, match="1F0"):
        Action.parse(text)  # type: ignore[arg-type]


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ScheduleError, match="Action.kind"):
        Action(0, "X", 0)
    with pytest.raises(ScheduleError, match="Action.stage"):
        Action(-1, "F", 0)
    with pytest.raises(ScheduleError, match="Action.microbatch"):
        Action(0, "F", True)


# ----------------------------------------------------------------------------- builders


def test_one_f_one_b_literal() -> None:
    got = [[str(a) for a in row] for row in one_f_one_b(3, 4).actions]
    assert got == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3".split(),
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3".split(),
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3".split(),
    ]


def test_gpipe_literal() -> None:
    got = [[str(a) for a in row] for row in gpipe(2, 3).actions]
    assert got == ["0F0 0F1 0F2 0B0 0B1 0B2".split(), "1F0 1F1 1F2 1B0 1B1 1B2".split()]


def test_docstring_table_is_the_grid() -> None:
    doc = schedule_module.__doc__
    lines = doc.splitlines()
    start = next(k for k, line in enumerate(lines) if line.strip().startswith("step"))
    table = "\n".join(line.strip() for line in lines[start:start + 4])
    assert table == "\n".join(line.strip() for line in format_grid(one_f_one_b(3, 4)).splitlines())


@pytest.mark.parametrize("P,M", SIZES)
def test_builders_validate(P: int, M: int) -> None:
    for sched in (gpipe(P, M), one_f_one_b(P, M), forward_only(P, M), build("1f1b", P, M), build("gpipe", P, M)):
        assert validate(sched) is sched
        for s, row in enumerate(sched.actions):
            assert all(a.stage == s for a in row)
            bs = [a.microbatch for a in row if a.kind == "B"]
            assert bs == sorted(bs)  # gradient accumulation order: ascending on every stage


@pytest.mark.parametrize("P,M", SIZES)
def test_max_in_flight(P: int, M: int) -> None:
    assert max_in_flight(one_f_one_b(P, M)) == tuple(min(M, P - s) for s in range(P))
    assert max_in_flight(gpipe(P, M)) == (M,) * P
    assert max_in_flight(forward_only(P, M)) == (0,) * P
    for name in ("1f1b", "gpipe"):
        assert in_flight(name, P, M) == max_in_flight(build(name, P, M))


def test_build_rejects_unknown_name() -> None:
    with pytest.raises(ScheduleError, match=r"\['1f1b', 'gpipe', 'zbh1'\].*'zb'"):
        build("zb", 2, 2)
    with pytest.raises(ScheduleError, match="num_stages"):
        build("1f1b", 0, 2)
    with pytest.raises(ScheduleError, match="num_microbatches"):
        gpipe(2, 0)


def test_schedule_rejects_wrong_row_count() -> None:
    with pytest.raises(ScheduleError, match="one row per stage"):
        Schedule("x", 3, 1, ((Action(0, "F", 0),),))


# ---------------------------------------------------------------------------- validator


def _assert_fails(sched: Schedule, marked: list[str], *words: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    for s in range(sched.num_stages):
        assert re.search(rf"^stage {s}\s+\|", msg, re.M), f"grid row for stage {s} missing:\n{msg}"
    assert sorted(re.findall(r"\[(\d+[FB]\d+)\]", msg)) == sorted(marked), msg
    for w in words:
        assert w in msg, msg
    return msg


def test_backward_before_forward() -> None:
    _assert_fails(_sched(["0F0 0B1 0F1 0B0"]), ["0B1"], "runs before 0F1")


def test_swapped_activation_receive_order() -> None:
    _assert_fails(_sched(["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"]), ["1F1"], "send order", "activation")


def test_swapped_gradient_send_order() -> None:
    _assert_fails(_sched(["0F0 0F1 0B0 0B1", "1F0 1F1 1B1 1B0"]), ["0B0"], "gradient")


def test_descending_backward_order_everywhere() -> None:
    _assert_fails(_sched(["0F0 0F1 0B1 0B0", "1F0 1F1 1B1 1B0"]), ["0B0"], "ascending")


def test_deadlock_cycle() -> None:
    # stage 0 wants 1B0 before sending 0F1, stage 1 wants 0F1 before running 1B0
    msg = _assert_fails(_sched(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]), ["0B0", "1F1"], "deadlock")
    assert "0B0 waits for 1B0" in msg and "1F1 waits for 0F1" in msg


def test_missing_duplicate_and_misplaced_actions() -> None:
    _assert_fails(_sched(["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"], M=2), [], "never runs 0B1")
    _assert_fails(_sched(["0F0 0F0 0B0"]), ["0F0", "0F0"], "more than once")
    _assert_fails(_sched(["0F0 1F0 0B0", "1B0"]), ["1F0"], "belongs to stage 1")
    _assert_fails(_sched(["0F0 0F1 0B0 0B1"], M=1), ["0F1"], "out of range")
    _assert_fails(_sched(["0F0 0B0"], training=False), ["0B0"], "forward-only")


def test_valid_hand_schedule_passes() -> None:
    # a different but legal interleaving: stage 0 runs two forwards ahead, stage 1 does 1F1B
    sched = _sched(["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"])
    assert validate(sched) is sched
    assert max_in_flight(sched) == (3, 1)


def test_format_grid_marks_and_aligns() -> None:
    grid = format_grid(gpipe(2, 2), mark=Action(1, "B", 1))
    assert grid.splitlines() == [
        "step    |  0     1     2     3",
        "stage 0 |  0F0   0F1   0B0   0B1",
        "stage 1 |  1F0   1F1   1B0  [1B1]",
    ]
    assert "[" not in format_grid(gpipe(2, 2))


# ------------------------------------------------------------------ cross-subnet validation


def _subnets(rows: list[str], T: int, uses, **kw) -> Schedule:
    return _sched(rows, num_subnets=T, uses=uses, **kw)


def test_validator_rejects_breaking_op_update_order() -> None:
    uses = (({"w"}, set()), ({"w"}, set()))
    ok = _subnets(["0F0 0B0 0U 0F0@1 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"], 2, uses)
    assert validate(ok) is ok
    bad = _subnets(["0F0 0B0 0F0@1 0U 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"], 2, uses)
    msg = _assert_fails_cross(bad, ["0F0@1", "0U"], "breaks the op update order", "['w']", "subnet 1")
    assert "as updated by subnet 0" in msg


def _assert_fails_cross(sched: Schedule, marked: list[str], *words: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    assert sorted(re.findall(r"\[(\d+[FBU]\d*(?:@\d+)?)\]", msg)) == sorted(marked), msg
    for w in words:
        assert w in msg, msg
    return msg


def test_validator_cross_subnet_completeness() -> None:
    uses = ((set(),), (set(),))
    _assert_fails_cross(_subnets(["0F0 0B0 0U 0F0@1 0B0@1"], 2, uses), [], "never runs 0U@1")
    _assert_fails_cross(_subnets(["0F0 0U 0B0 0F0@1 0B0@1 0U@1"], 2, uses), ["0U"], "runs before 0B0")
    _assert_fails_cross(_subnets(["0F0 0B0 0U 0U 0F0@1 0B0@1 0U@1"], 2, uses), ["0U", "0U"], "more than once")
    _assert_fails_cross(_subnets(["0F0 0B0 0U 0F0@1 0B0@1 0U@1 0F0@2"], 2, uses), ["0F0@2"], "out of range")
    with pytest.raises(ScheduleError, match="expected 2 subnets x 1 stages"):
        _subnets(["0F0 0B0 0U"], 2, ((set(),),))


def test_validator_cross_subnet_deadlock_names_the_waits() -> None:
    uses = ((set(), set()),) * 2
    sched = _subnets(["0F0 0B0 0F0@1 0U 0B0@1 0U@1", "1F0@1 1B0@1 1F0 1B0 1U 1U@1"], 2, uses)
    msg = _assert_fails_cross(sched, ["0B0", "1F0@1"], "deadlock")
    assert "0B0 waits for 1B0" in msg and "1F0@1 waits for 0F0@1" in msg


def test_one_subnet_schedules_are_unchanged_by_the_subnet_field() -> None:
    for P, M in SIZES[:20]:
        sched = one_f_one_b(P, M)
        assert sched.num_subnets == 1 and not sched.updates and sched.uses is None
        assert all(a.subnet == 0 for row in sched.actions for a in row)
