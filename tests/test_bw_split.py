"""The B/W split (issue 23 part 4): W actions as data, the validator, ZB-H1, the simulator's
times and memory until W, and the admission builder placing each W where its stage would idle."""
from __future__ import annotations

import itertools
import random
import re

import pytest

import pipeline.plan.schedule as schedule_module
from pipeline.plan.admission import SubnetWork, _admit, cross_subnet, flushed, in_flight_bound, sequential
from pipeline.plan.clock import WEIGHT_SHARE
from pipeline.plan.schedule import (
    Action, Schedule, ScheduleError, Wait, build, format_grid, in_flight, max_in_flight, one_f_one_b, validate,
    zb_h1,
)
from pipeline.plan.simulate import SimulationError, simulate
from test_admission import MODES, check_sequential_semantics, check_window, random_instance
from test_schedule import _sched, _subnets

SMALL = list(itertools.product(range(1, 5), range(1, 7)))  # P in 1..4, M in 1..6


def _fails(sched: Schedule, marked: list[str], *words: str) -> str:
    """validate() rejects ``sched``, marks exactly ``marked`` on the grid and says ``words``."""
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    assert set(re.findall(r"\[(\d+[FBWU]\d*(?:@\d+)?)\]", msg)) == set(marked), msg  # (a repeat shows twice)
    for w in words:
        assert w in msg, msg
    return msg


# ------------------------------------------------------------------------------ W as data


@pytest.mark.parametrize("text", ["1W0", "1W2@5", "0W11", "3W0@12"])
def test_w_round_trip(text: str) -> None:
    a = Action.parse(text)
    assert a.kind == "W" and str(a) == text and Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["1W", "1w0", "1W@2", "W0", "1WB0"])
def test_w_parse_rejects(text: str) -> None:
    with pytest.raises(ScheduleError, match="F|B|W"):
        Action.parse(text)


def test_split_pairs_and_input_only_backwards() -> None:
    sched = _sched(["0F0 0F1 0B0 0B1 0W0 0W1", "1F0 1B0 1F1 1B1"])
    assert sched.split == frozenset({(0, 0)})
    assert sched.input_only(Action(0, "B", 1)) and not sched.input_only(Action(1, "B", 1))
    assert not sched.input_only(Action(0, "W", 1)) and not sched.input_only(Action(0, "F", 1))
    # the activations' hold ends at the W of a split backward, at the B of a whole one
    assert sched.releases(Action(0, "W", 1)) and not sched.releases(Action(0, "B", 1))
    assert sched.releases(Action(1, "B", 1)) and not sched.releases(Action(1, "F", 1))
    assert one_f_one_b(3, 4).split == frozenset()  # no W: every B is the whole backward, as before


def test_wait_rule_of_w_and_of_the_update() -> None:
    uses = ((set(), set()),)
    sched = _subnets(["0F0 0B0 0W0 0U", "1F0 1B0 1U"], 1, uses)
    rule = sched.rule
    assert rule.waits(Action(0, "W", 0)) == (Wait(Action(0, "B", 0)),)
    # a split (subnet, stage) updates after its weight gradients; an unsplit one after its backwards
    assert Wait(Action(0, "W", 0)) in rule.waits(Action(0, "U", 0))
    assert Wait(Action(0, "B", 0)) not in rule.waits(Action(0, "U", 0))
    assert Wait(Action(1, "B", 0)) in rule.waits(Action(1, "U", 0))
    # W sends and receives nothing; the split B still sends the input gradient
    assert rule.sends(Action(0, "W", 0)) == ()
    assert rule.sends(Action(1, "B", 0)) == ((0, Wait(Action(1, "B", 0), "gradient")),)
    assert all(w.message is None for w in rule.waits(Action(0, "W", 0)))


# ------------------------------------------------------------------------------ validation


def test_validator_accepts_a_hand_split_schedule() -> None:
    ok = _sched(["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1"])
    assert validate(ok) is ok


def test_validator_rejects_w_before_its_b() -> None:
    _fails(_sched(["0F0 0W0 0B0"]), ["0W0"], "0W0 runs before 0B0", "expected W after its B")


def test_validator_rejects_w_out_of_micro_batch_order() -> None:
    _fails(_sched(["0F0 0F1 0B0 0B1 0W1 0W0"]), ["0W0"], "weight gradients must run in ascending micro-batch")


def test_validator_rejects_a_mix_of_split_and_unsplit_backwards() -> None:
    msg = _fails(_sched(["0F0 0F1 0F2 0B0 0B1 0W1 0B2"]), ["0B0", "0B2"], "splits the backward",
                 "expected a W for every micro-batch of a (subnet, stage) or for none")
    assert "micro-batches [1]" in msg and "not of [0, 2]" in msg


def test_validator_rejects_an_update_before_a_weight_gradient() -> None:
    uses = ((set(),), (set(),))
    bad = _subnets(["0F0 0B0 0U 0W0 0F0@1 0B0@1 0U@1"], 2, uses)
    _fails(bad, ["0U"], "0U runs before 0W0", "an update needs every weight gradient")


def test_validator_rejects_other_malformed_ws() -> None:
    _fails(_sched(["0F0 0B0 0W0 0W0"]), ["0W0"], "appears more than once")
    _fails(_sched(["0F0 0B0 1W0", "1F0 1B0 1W0"]), ["1W0"], "belongs to stage 1")
    _fails(_sched(["0F0 0B0 0W1"], M=1), ["0W1"], "out of range")
    _fails(_sched(["0F0 0W0"], training=False), ["0W0"], "forward-only")


# ------------------------------------------------------------------------------------ ZB-H1


def test_zb_h1_docstring_table_is_the_grid() -> None:
    lines = [line.strip() for line in schedule_module.__doc__.splitlines()]
    start = lines.index(next(x for x in lines if x.startswith("stage 0 |  0F0   0F1   0F2   0B0   0W0")))
    assert lines[start:start + 3] == [line.strip() for line in format_grid(zb_h1(3, 4)).splitlines()[1:]]


@pytest.mark.parametrize("P,M", SMALL)
def test_zb_h1_shape(P: int, M: int) -> None:
    sched = build("zbh1", P, M)
    assert validate(sched) is sched and sched.name == "zbh1"
    ref = one_f_one_b(P, M)
    assert sched.split == frozenset((0, s) for s in range(P))  # every backward split
    for s, row in enumerate(sched.actions):
        # forwards and backwards in 1F1B's order; weight gradients ascending, each after its B
        assert [a for a in row if a.kind != "W"] == list(ref.actions[s])
        ws = [a.microbatch for a in row if a.kind == "W"]
        assert ws == list(range(M))
        pos = {a: k for k, a in enumerate(row)}
        for m in range(M):
            # stage s runs W(m) right after B(m + s): s weight gradients late, the rest in the drain
            b = Action(s, "B", min(m + s, M - 1))
            assert pos[b] < pos[Action(s, "W", m)]
        last_b = max(pos[Action(s, "B", m)] for m in range(M))
        assert [a.kind for a in row[last_b + 1:]] == ["W"] * min(s + 1, M)
    # activations held until W: min(M, P) on every stage, 1F1B's peak (its stage 0's)
    assert max_in_flight(sched) == in_flight("zbh1", P, M) == (min(M, P),) * P
    assert max(max_in_flight(sched)) == max(max_in_flight(ref))


@pytest.mark.parametrize("P,M", SMALL)
def test_zb_h1_is_no_slower_than_one_f_one_b(P: int, M: int) -> None:
    rng = random.Random(P * 10 + M)
    for f, b, c in ((1.0, 2.0, 0.0), (1.0, 2.0, 0.25), (1.5, 2.5, 0.5), *((rng.uniform(.5, 2), rng.uniform(1, 4),
                                                                          rng.uniform(0, .5)) for _ in range(3))):
        # equal costs per stage, B = W = bwd / 2 (the default share)
        z = simulate(zb_h1(P, M), [f] * P, [b] * P, [c] * (P - 1))
        o = simulate(one_f_one_b(P, M), [f] * P, [b] * P, [c] * (P - 1))
        assert z.step_time <= o.step_time + 1e-9
        assert sum(z.busy) == pytest.approx(sum(o.busy))  # the same work, split in two
        assert z.peak_in_flight == max_in_flight(zb_h1(P, M))
    if M >= P:
        # the paper's figure: the W fill the drain, so the bubble is (P - 1)(F + B - W), B = W
        r = simulate(zb_h1(P, M), [1.0] * P, [2.0] * P, [0.0] * (P - 1))
        assert r.step_time == M * 3.0 + (P - 1) * 1.0


# ------------------------------------------------------------------------------- simulator


def test_split_backward_times() -> None:
    sched = zb_h1(2, 2)
    r = simulate(sched, [1.0, 1.0], [4.0, 3.0], [0.0], bwd_weight_time=[1.0, 2.0])
    for s, row in enumerate(r.timeline):
        for sp in row:
            want = {"F": 1.0, "B": (3.0, 1.0)[s], "W": (1.0, 2.0)[s]}[sp.action.kind]
            assert sp.end - sp.start == want, sp.action
    r = simulate(sched, [1.0, 1.0], [4.0, 3.0], [0.0])  # default: half the backward each
    assert {sp.end - sp.start for sp in r.timeline[1] if sp.action.kind in "BW"} == {3.0 * WEIGHT_SHARE}
    # unsplit schedules ignore the share: B is the whole backward, as before
    r = simulate(one_f_one_b(2, 2), [1.0, 1.0], [4.0, 3.0], [0.0], bwd_weight_time=[1.0, 2.0])
    assert {sp.end - sp.start for sp in r.timeline[0] if sp.action.kind == "B"} == {4.0}


def test_split_backward_per_subnet_costs() -> None:
    work = [SubnetWork((frozenset({"a"}), frozenset()), (1.0, 1.0), (4.0, 2.0), (0.5,), (0.25, 0.25), (3.0, 0.5))]
    sched = sequential(zb_h1(2, 2), [w.uses for w in work])
    r = simulate(sched, work=work)
    for s, row in enumerate(r.timeline):
        for sp in row:
            want = {"F": 1.0, "B": (1.0, 1.5)[s], "W": (3.0, 0.5)[s], "U": 0.25}[sp.action.kind]
            assert sp.end - sp.start == want, sp.action
    assert SubnetWork((frozenset(),), (1.0,), (3.0,)).bwd_weight == (3.0 * WEIGHT_SHARE,)


def test_split_cost_errors() -> None:
    with pytest.raises(SimulationError, match=r"bwd_weight_time\[1\]: expected at most the backward's 3.0"):
        simulate(zb_h1(2, 2), [1.0, 1.0], [4.0, 3.0], [0.0], bwd_weight_time=[1.0, 3.5])
    with pytest.raises(SimulationError, match="bwd_weight_time: expected 2 values"):
        simulate(zb_h1(2, 2), [1.0, 1.0], [4.0, 3.0], [0.0], bwd_weight_time=[1.0])
    work = [SubnetWork((frozenset(),), (1.0,), (2.0,))]
    with pytest.raises(SimulationError, match="costs given twice"):
        simulate(sequential(zb_h1(1, 1), [w.uses for w in work]), work=work, bwd_weight_time=[1.0])
    with pytest.raises(ScheduleError, match="SubnetWork.bwd_weight: expected at most bwd"):
        SubnetWork((frozenset(),), (1.0,), (2.0,), bwd_weight=(2.5,))
    with pytest.raises(ScheduleError, match="SubnetWork.bwd_weight: expected 2 finite"):
        SubnetWork((frozenset(), frozenset()), (1.0, 1.0), (2.0, 2.0), bwd_weight=(1.0,))


def test_activations_are_held_until_the_weight_gradient() -> None:
    # the same F/B order; only where W runs differs: before the next F (one held) or after it (two)
    early = _sched(["0F0 0B0 0W0 0F1 0B1 0W1"])
    late = _sched(["0F0 0B0 0F1 0W0 0B1 0W1"])
    unsplit = _sched(["0F0 0B0 0F1 0B1"])
    assert (max_in_flight(early), max_in_flight(late), max_in_flight(unsplit)) == ((1,), (2,), (1,))
    for sched, peak in ((early, 1), (late, 2), (unsplit, 1)):
        r = simulate(sched, [1.0], [2.0], [], static_bytes=[10.0], act_bytes=[3.0])
        assert r.peak_in_flight == (peak,) and r.peak_memory == (10.0 + 3.0 * peak,)
    # a W that ends as the next F starts frees first (same-instant events in action order)
    r = simulate(early, [1.0], [2.0], [], bwd_weight_time=[2.0])  # B takes 0, W 2
    assert r.peak_in_flight == (1,)
    # ZB-H1 on a stage: the simulated peak is the list's count
    for P, M in SMALL:
        r = simulate(zb_h1(P, M), [1.0] * P, [2.0] * P, [0.1] * (P - 1), static_bytes=[0.0] * P, act_bytes=[1.0] * P)
        assert r.peak_in_flight == max_in_flight(zb_h1(P, M)) and r.peak_memory == tuple(map(float, r.peak_in_flight))


# ----------------------------------------------------------------------- the admission builder


def _check_split(sched: Schedule) -> None:
    """Every backward split; on each stage, each W after its B, ascending per subnet, and
    every W of a subnet before that subnet's update there."""
    P, M, T = sched.num_stages, sched.num_microbatches, sched.num_subnets
    assert sched.split == frozenset((t, s) for t in range(T) for s in range(P))
    for s, row in enumerate(sched.actions):
        pos = {a: k for k, a in enumerate(row)}
        for t in range(T):
            ws = [pos[Action(s, "W", m, t)] for m in range(M)]
            assert ws == sorted(ws)
            for m in range(M):
                assert pos[Action(s, "B", m, t)] < pos[Action(s, "W", m, t)] < pos[Action(s, "U", 0, t)]


CASES = [(mode, seed) for mode in MODES for seed in range(0, 80, 4)]


@pytest.mark.parametrize("mode,seed", CASES)
def test_split_schedules_keep_the_semantics_and_place_w_after_b_before_u(mode: str, seed: int) -> None:
    rng = random.Random(seed * 7 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    sched = cross_subnet(work, M, window, split=True, **kw)
    assert validate(sched) is sched
    _check_split(sched)
    check_sequential_semantics(sched, {op: mode for op in ("stem", "head")}, kw["delay"])
    check_window(sched, window)
    P = sched.num_stages
    # held until W, within the split's cap: P on every stage (ZB-H1's rule)
    assert all(peak <= c for c, peak in zip(in_flight_bound(P, M, window, split=True), max_in_flight(sched)))
    assert in_flight_bound(P, M, window, split=True) == tuple(min(P, window * M) for _ in range(P))
    # without the split, the same instance gives exactly the schedule it gave before (no W)
    plain = cross_subnet(work, M, window, **kw)
    assert plain.split == frozenset()
    # the split never costs here: these instances all finish no later with it
    split_r = simulate(sched, work=work, state_time=kw["state_time"])
    plain_r = simulate(plain, work=work, state_time=kw["state_time"])
    assert split_r.step_time <= plain_r.step_time + 1e-9
    assert sum(split_r.busy) == pytest.approx(sum(plain_r.busy))


@pytest.mark.parametrize("mode,seed", CASES[::2])
def test_a_w_runs_only_where_no_backward_or_update_is_ready(mode: str, seed: int) -> None:
    """The builder's clock: when a W starts, every backward of a subnet whose forward ran
    before it there, and every update whose weight gradients all ran, is not ready yet (else the
    stage would have run that instead); and the estimates are what the simulator replays."""
    rng = random.Random(seed * 7 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    sched, clock = _admit(work, M, window, cap=None, name="cross", split=True, **kw)
    r = simulate(sched, work=work, state_time=kw["state_time"])
    for row in r.timeline:
        for sp in row:
            assert (sp.start, sp.end) == (clock.start[clock.id(sp.action)], clock.end[clock.id(sp.action)])
    for s, row in enumerate(sched.actions):
        for k, w in enumerate(row):
            if w.kind != "W":
                continue
            before, start = set(row[:k]), clock.start[clock.id(w)]
            pending = {}
            for a in row[k + 1:]:
                ok = (a.kind == "B" and Action(s, "F", a.microbatch, a.subnet) in before) or (
                    a.kind == "U" and all(Action(s, "W", m, a.subnet) in before for m in range(M)))
                if ok and (a.kind, a.subnet) not in pending:  # the next B (or the U) of its subnet
                    pending[(a.kind, a.subnet)] = a
                elif a.kind == "B":
                    pending.setdefault(("B", a.subnet), None)
            for a in filter(None, pending.values()):
                assert clock.ready(clock.id(a)) > start, f"{w} delays {a}, ready at {clock.ready(clock.id(a))}"


def test_window_one_with_equal_costs_runs_each_w_right_after_its_b() -> None:
    """Flushed, equal costs, 1F1B's cap (P - s, not the split's default P) held until W: 1F1B's
    order with each W where the stage would wait for the next gradient or the cap, i.e. right
    after its B; faster than 1F1B by the shorter backward on the critical path ((P - 1) x W per
    subnet)."""
    P, M, T = 3, 4, 2
    work = [SubnetWork(tuple({f"w{s}"} for s in range(P)), (1.0,) * P, (2.0,) * P) for _ in range(T)]
    sched = flushed(work, M, split=True, cap=[P - s for s in range(P)])
    ref = one_f_one_b(P, M)
    for s, row in enumerate(sched.actions):
        want = [x for t in range(T) for a in (*ref.actions[s], Action(s, "U", 0)) for x in (
            (Action(s, a.kind, a.microbatch, t), Action(s, "W", a.microbatch, t)) if a.kind == "B"
            else (Action(s, a.kind, a.microbatch, t),))]
        assert list(row) == want
    plain = simulate(flushed(work, M), work=work).step_time
    assert plain == T * (M + P - 1) * 3.0
    assert simulate(sched, work=work).step_time == plain - T * (P - 1) * 1.0


@pytest.mark.parametrize("P,M", [(2, 1), (3, 2), (4, 4), (4, 1)])
def test_split_utilisation_is_no_lower_on_small_cost_settings(P: int, M: int) -> None:
    for fwd, bwd, send, window, cap in ((1.0, 2.0, 0.0, 1, None), (1.0, 2.0, 0.2, 2, None), (0.5, 2.0, 0.1, 3, None),
                                        (1.0, 3.0, 0.0, 2, [P] * P)):
        work = [SubnetWork(tuple({f"op{t % 3}_{s}"} for s in range(P)), (fwd,) * P, (bwd,) * P, (send,) * (P - 1))
                for t in range(6)]
        util = []
        for split in (False, True):
            r = simulate(cross_subnet(work, M, window, cap=cap, split=split), work=work)
            util.append(sum(r.busy) / (P * r.step_time))
        assert util[1] >= util[0] - 1e-12, (fwd, bwd, send, window, util)
