"""Admission: the cross-subnet list scheduler, checked against the sequential semantics.

The semantic checks never copy the rule's numbers: from the subnets' op uses alone they derive
which update each forward must read (exact: the previous user's; delayed: the one ``delay + 1``
users back; frozen: none) and require it on the built schedule's happens-before graph (each
stage's list order plus every wait the executor makes), so they hold in every execution the
executor may run, whatever the real times.
"""
from __future__ import annotations

import itertools
import random
import re

import pytest

from pipeline.plan.admission import (
    ActivationCap, ArenaBound, SubnetWork, _admit, cross_subnet, flushed, sequential, stage_caps,
)
from pipeline.plan.schedule import Action, Schedule, ScheduleError, Wait, max_in_flight, one_f_one_b, validate
from pipeline.plan.simulate import simulate
from test_schedule import _subnets


def _work(uses, fwd=1.0, bwd=2.0, send=0.0, update=0.0) -> SubnetWork:
    P = len(uses)
    return SubnetWork(tuple(frozenset(u) for u in uses), (fwd,) * P, (bwd,) * P, (send,) * (P - 1), (update,) * P)


def _rows(sched: Schedule) -> list[list[str]]:
    return [[str(a) for a in row] for row in sched.actions]


# ------------------------------------------------------------------ the happens-before graph


def _happens_before(sched: Schedule) -> dict[Action, int]:
    """For every action, the bitset of the actions that end before it starts in every execution:
    the closure of each stage's list order and the rule's waits (what the executor waits for)."""
    actions = [a for row in sched.actions for a in row]
    index = {a: k for k, a in enumerate(actions)}
    preds: dict[Action, list[Action]] = {a: [] for a in actions}
    for row in sched.actions:
        for prev, a in zip(row, row[1:]):
            preds[a].append(prev)
    for a in actions:
        preds[a] += [w.action for w in sched.rule.waits(a) if w.action is not None]
    before: dict[Action, int] = {}

    def visit(a: Action, stack: frozenset = frozenset()) -> int:
        if a in before:
            return before[a]
        assert a not in stack, f"cycle through {a}"
        bits = 0
        for p in preds[a]:
            bits |= visit(p, stack | {a}) | (1 << index[p])
        before[a] = bits
        return bits

    for a in actions:
        visit(a)
    return {a: before[a] for a in actions}, index


def _users(uses) -> dict[str, list[tuple[int, int]]]:
    """Per op, its (subnet, stage) uses in subnet order: derived from the uses alone."""
    out: dict[str, list[tuple[int, int]]] = {}
    for t, row in enumerate(uses):
        for s, ops in enumerate(row):
            for op in ops:
                out.setdefault(op, []).append((t, s))
    return out


def check_sequential_semantics(sched: Schedule, mode_of: dict[str, str], delay: int) -> None:
    """Every op is updated in subnet order and every forward reads the version the semantics
    names, in every execution: ``mode_of[op]`` is ``exact``, ``delayed`` or ``frozen``."""
    hb, index = _happens_before(sched)

    def precedes(a: Action, b: Action) -> bool:
        return bool(hb[b] >> index[a] & 1)

    U = lambda t, s: Action(s, "U", 0, t)  # noqa: E731
    for op, us in _users(sched.uses).items():
        mode = mode_of.get(op, "exact")
        for k, (t, s) in enumerate(us):
            first = Action(s, "F", 0, t)
            # updates of the op in subnet order (a frozen op is never updated: no order needed)
            if k > 0 and mode != "frozen":
                assert precedes(U(*us[k - 1]), U(t, s)), f"{op}: update of subnet {t} may run before subnet {us[k - 1][0]}'s"
            # the version read: produced by the user `back` uses earlier, and not yet overwritten
            # beyond what the ring of delay + 1 versions keeps (the subnet's own update comes after it)
            back = {"exact": 1, "delayed": delay + 1}.get(mode)
            if back is not None and k - back >= 0:
                assert precedes(U(*us[k - back]), first), (
                    f"{op}: {first} may read it before the update of subnet {us[k - back][0]} ({mode})")
            assert precedes(first, U(t, s))
            # the op sits on the stage that runs it: moved after the previous user's update
            if k > 0 and us[k - 1][1] != s:
                assert mode == "exact", f"{op}: a {mode} op moved stage"
                assert precedes(U(*us[k - 1]), first), f"{op} may be used on stage {s} before it left stage {us[k - 1][1]}"
            # every micro-batch of the subnet runs on that version: all before its own update
            for m in range(sched.num_microbatches):
                assert precedes(Action(s, "B", m, t), U(t, s))
            # and no later user's update can overwrite it first
            if k + 1 < len(us) and mode != "frozen":
                assert precedes(U(t, s), U(*us[k + 1]))


def check_window(sched: Schedule, window: int) -> None:
    """On every stage, at most ``window`` subnets between their first action and their update there."""
    for row in sched.actions:
        open_: set[int] = set()
        for a in row:
            open_.add(a.subnet)
            assert len(open_) <= window, f"stage {a.stage}: subnets {sorted(open_)} in flight at {a}, window {window}"
            if a.kind == "U":
                open_.discard(a.subnet)


# ------------------------------------------------------------------------ random instances


def random_instance(rng: random.Random, mode: str):
    """P <= 4, M <= 3, T <= 6 subnets over a small op pool; shared ops (in every subnet) stay on
    their stage, the others may move between subnets; random costs, window, delay, origin."""
    P, M, T = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)
    shared = {"stem": 0, "head": P - 1}
    pool = [f"op{k}" for k in range(rng.randint(1, 6))]
    work = []
    for _ in range(T):
        uses = [set() for _ in range(P)]
        for op, s in shared.items():
            uses[s].add(op)
        for op in rng.sample(pool, rng.randint(0, len(pool))):
            uses[rng.randrange(P)].add(op)
        work.append(SubnetWork(tuple(frozenset(u) for u in uses), tuple(rng.uniform(0.1, 2) for _ in range(P)),
                               tuple(rng.uniform(0.1, 3) for _ in range(P)),
                               tuple(rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(P - 1)),
                               tuple(rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(P))))
    delay = rng.randint(1, 3) if mode == "delayed" else 0
    kw = dict(frozen=frozenset(shared) if mode == "frozen" else frozenset(),
              delayed=frozenset(shared) if mode == "delayed" else frozenset(), delay=delay,
              origin={op: rng.randrange(P) for op in pool if rng.random() < 0.5} | shared,
              state_time={op: rng.uniform(0, 3) for op in pool})
    return work, M, rng.randint(1, T + 1), kw


MODES = ("exact", "delayed", "frozen")
CASES = [(mode, seed) for mode in MODES for seed in range(80)]


@pytest.mark.parametrize("mode,seed", CASES)
def test_random_instances_keep_the_sequential_semantics(mode: str, seed: int) -> None:
    rng = random.Random(seed * 7 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    sched = cross_subnet(work, M, window, **kw)
    assert validate(sched) is sched
    assert sched.num_subnets == len(work) and sched.uses == tuple(w.uses for w in work)
    mode_of = {op: mode for op in ("stem", "head")}
    check_sequential_semantics(sched, mode_of, kw["delay"])
    check_window(sched, window)
    P = sched.num_stages
    assert all(peak <= P - s for s, peak in enumerate(max_in_flight(sched)))


@pytest.mark.parametrize("P,M,T", list(itertools.product(range(1, 5), range(1, 4), (1, 3))))
def test_every_built_schedule_validates(P: int, M: int, T: int) -> None:
    for window in range(1, T + 2):
        for mode in MODES:
            # the stem on stage 0 in every subnet, and one of two ops there that alternate
            work = [_work([{"stem", f"a{t % 2}"}] + [set()] * (P - 1)) for t in range(T)]
            kw = {"exact": {}, "frozen": dict(frozen=frozenset({"stem"})),
                  "delayed": dict(delayed=frozenset({"stem"}), delay=1)}[mode]
            sched = cross_subnet(work, M, window, **kw)
            validate(sched)
            check_window(sched, window)


# --------------------------------------------------------------------- window 1 is 1F1B


@pytest.mark.parametrize("P,M", list(itertools.product(range(1, 7), range(1, 9))))
def test_window_one_is_one_f_one_b_per_subnet(P: int, M: int) -> None:
    """With equal stage costs, a flushed step per subnet, each in 1F1B's exact order plus U."""
    T = 3
    ref = one_f_one_b(P, M)
    for uses in ([{f"w{s}"} for s in range(P)], [set()] * P):  # conflicting every subnet, or never
        sched = flushed([_work(uses, 1.0, 2.0, 0.25) for _ in range(T)], M)
        assert validate(sched) is sched
        for s in range(P):
            expected = [Action(s, a.kind, a.microbatch, t) for t in range(T)
                        for a in (*ref.actions[s], Action(s, "U", 0))]
            assert list(sched.actions[s]) == expected


@pytest.mark.parametrize("seed", range(40))
def test_window_one_with_any_costs_flushes_within_one_f_one_b_bounds(seed: int) -> None:
    """With unequal costs the list scheduler may run a ready backward before a forward that
    1F1B would wait for; it still flushes each subnet, holds no more than 1F1B, and keeps the
    micro-batch order."""
    rng = random.Random(seed)
    P, M, T = rng.randint(1, 5), rng.randint(1, 6), rng.randint(1, 3)
    work = [SubnetWork((frozenset(),) * P, tuple(rng.uniform(0.1, 3) for _ in range(P)),
                       tuple(rng.uniform(0.1, 3) for _ in range(P)), tuple(rng.uniform(0, 1) for _ in range(P - 1)))
            for _ in range(T)]
    sched = flushed(work, M)
    validate(sched)
    assert all(p <= min(M, P - s) for s, p in enumerate(max_in_flight(sched)))
    for s, row in enumerate(sched.actions):
        # one subnet at a time on each stage, its update last
        assert [a.subnet for a in row] == sorted(a.subnet for a in row)
        assert [a for a in row if a.kind == "U"] == [row[k] for k in range(2 * M, len(row), 2 * M + 1)]


# ------------------------------------------------------------- the builder and the simulator


@pytest.mark.parametrize("mode,seed", CASES[::3])
def test_the_builders_estimates_are_what_the_simulator_replays(mode: str, seed: int) -> None:
    """The builder times its choices with the simulator's clock, in the order it picks them;
    the simulator replays the finished lists: the same start and end for every action, so the
    builder's list scheduling implies exactly the simulated makespan."""
    rng = random.Random(seed * 7 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    sched, clock = _admit(work, M, window, cap=None, name="cross", **kw)
    r = simulate(sched, work=work, state_time=kw["state_time"])
    for row in r.timeline:
        assert [sp.start for sp in row] == sorted(sp.start for sp in row)  # list order = start order
        for sp in row:
            i = clock.id(sp.action)
            assert (sp.start, sp.end) == (clock.start[i], clock.end[i]), sp.action
    assert r.step_time == max(clock.end)
    # and on the timeline: each op updated in subnet order, each first forward after the
    # update it reads (plus the op's move when it changed stage)
    span = {sp.action: sp for row in r.timeline for sp in row}
    back = {"exact": 1, "delayed": kw["delay"] + 1, "frozen": None}
    for op, us in _users(sched.uses).items():
        b = back[mode if op in ("stem", "head") else "exact"]
        ends = [span[Action(s, "U", 0, t)].end for t, s in us]
        if b is not None:
            assert ends == sorted(ends), op
        for k, (t, s) in enumerate(us):
            if b is not None and k >= b:
                t0, s0 = us[k - b]
                move = kw["state_time"].get(op, 0.0) if us[k - 1][1] != s else 0.0
                assert span[Action(s, "F", 0, t)].start >= span[Action(s0, "U", 0, t0)].end + move - 1e-12


def test_a_subnet_waiting_further_down_runs_ahead_one_micro_batch_at_a_time() -> None:
    """Subnet 1 could fill stage 0's slots while subnet 0 waits for op a to arrive there;
    subnet 1's forward on stage 1 needs a after subnet 0's update on stage 0: a deadlock the
    builder used to run into ('no stage can progress'). Subnet 1 runs ahead with one
    micro-batch, whatever the cap, and the rest follows subnet 0's update."""
    for M, cap in ((2, None), (3, [4, 1])):
        work = [SubnetWork(({"a"}, set()), (1.0, 1.0), (2.0, 2.0)), SubnetWork((set(), {"a"}), (1.0, 1.0), (2.0, 2.0))]
        sched = cross_subnet(work, M, 2, origin={"a": 1}, state_time={"a": 5.0}, cap=cap)
        validate(sched)
        row = _rows(sched)[0]
        assert row[:2] == ["0F0@1", "0F0"]
        assert row.index("0U") < row.index("0F1@1")
        check_sequential_semantics(sched, {}, 0)


def test_a_wide_window_is_not_clogged_by_subnets_that_wait_further_down() -> None:
    """Subnets that conflict further down used to take every slot but one on the stages above
    the conflict, leaving the pipeline one micro-batch wide: window 6 then did no better than
    window 2 (58 s both). One micro-batch ahead per stage leaves room for the rest (51 s)."""
    at = [(1, "w2"), (3, "w2"), (2, "w0"), (2, "w0"), (1, "w0"), (2, "w1")]
    work = [_work([{op} if s == stage else set() for s in range(4)]) for stage, op in at]
    wide = simulate(cross_subnet(work, 2, 6), work=work).step_time
    assert wide == 51.0
    assert wide < simulate(cross_subnet(work, 2, 2), work=work).step_time


# ------------------------------------------------------------------- overtaking, conflicts


def test_a_later_subnet_overtakes_one_blocked_by_a_conflict() -> None:
    # subnet 1 needs op a (stage 0) that subnet 0 updates; subnet 2 uses c there: no conflict
    work = [_work([{"a"}, {"b"}]), _work([{"a"}, {"d"}]), _work([{"c"}, {"e"}])]
    sched = cross_subnet(work, 1, 3)
    validate(sched)
    row0 = list(sched.actions[0])
    pos = {a: k for k, a in enumerate(row0)}
    assert pos[Action(0, "F", 0, 2)] < pos[Action(0, "F", 0, 1)], _rows(sched)
    assert pos[Action(0, "U", 0, 0)] < pos[Action(0, "F", 0, 1)]  # the blocked one reads 0's update
    # with a window of 2, subnet 2 cannot enter before subnet 0 is done
    narrow = cross_subnet(work, 1, 2)
    check_window(narrow, 2)
    pos = {a: k for k, a in enumerate(narrow.actions[0])}
    assert pos[Action(0, "U", 0, 0)] < pos[Action(0, "F", 0, 2)]


def test_the_docstring_example() -> None:
    import pipeline.plan.admission as admission
    work = [_work([{"a"}, {"b"}]), _work([{"c"}, {"d"}])]
    got = [" ".join(r) for r in _rows(cross_subnet(work, 2, 2))]
    doc = [line.split("|")[1].strip() for line in admission.__doc__.splitlines() if line.strip().startswith("stage")]
    assert [" ".join(x.split()) for x in doc] == got


def test_exact_shared_ops_flush_at_their_stage_and_frozen_or_delayed_overlap() -> None:
    P, M, T = 3, 2, 4
    work = [_work([{"stem", f"x{t}"}, {f"y{t}"}, {"head", f"z{t}"}]) for t in range(T)]
    exact = cross_subnet(work, M, T)
    for t in range(1, T):
        for s in (0, P - 1):  # the shared op's stages: every forward after the update before
            pos = {a: k for k, a in enumerate(exact.actions[s])}
            assert pos[Action(s, "U", 0, t - 1)] < pos[Action(s, "F", 0, t)]
    frozen = cross_subnet(work, M, T, frozen=frozenset({"stem", "head"}))
    delayed = cross_subnet(work, M, T, delayed=frozenset({"stem", "head"}), delay=1)
    for sched in (frozen, delayed):
        pos = {a: k for k, a in enumerate(sched.actions[0])}
        assert pos[Action(0, "F", 0, 1)] < pos[Action(0, "U", 0, 0)]  # subnet 1 enters before 0 updates
        check_sequential_semantics(sched, {"stem": "frozen" if sched is frozen else "delayed",
                                           "head": "frozen" if sched is frozen else "delayed"}, 1)
    # with delay 1, subnet 2 reads subnet 0's update of the stem: it waits for it
    pos = {a: k for k, a in enumerate(delayed.actions[0])}
    assert pos[Action(0, "U", 0, 0)] < pos[Action(0, "F", 0, 2)]


def test_ops_without_state_never_conflict() -> None:
    # identity/zero/sum have no parameters: they are simply not in `uses`
    work = [_work([set(), set()]) for _ in range(3)]
    sched = cross_subnet(work, 1, 3)
    pos = {a: k for k, a in enumerate(sched.actions[0])}
    assert pos[Action(0, "F", 0, 1)] < pos[Action(0, "U", 0, 0)]


def test_an_op_that_moves_waits_for_the_update_on_its_old_stage() -> None:
    work = [_work([{"a"}, set()]), _work([set(), {"a"}])]
    sched = cross_subnet(work, 1, 2, state_time={"a": 5.0})
    validate(sched)
    (mv,) = sched.rule.moves()
    assert (mv.op, mv.src, mv.dst, mv.after, mv.before) == ("a", 0, 1, Action(0, "U", 0, 0), Action(1, "F", 0, 1))
    assert any(w.message == "state" and w.op == "a" and w.action == Action(0, "U", 0, 0)
               for w in sched.rule.waits(Action(1, "F", 0, 1)))
    check_sequential_semantics(sched, {}, 0)
    # from an origin elsewhere, the first user waits for the move at the start
    moved = cross_subnet(work, 1, 2, origin={"a": 1})
    assert [w for w in moved.rule.waits(Action(0, "F", 0, 0)) if w.message == "state"][0].action is None


# ------------------------------------------------------------------------ in-flight cap


@pytest.mark.parametrize("P,M", [(1, 3), (2, 3), (3, 2), (4, 3)])
def test_in_flight_cap(P: int, M: int) -> None:
    work = [_work([set()] * P) for _ in range(4)]
    sched = cross_subnet(work, M, 4)
    assert all(p <= P - s for s, p in enumerate(max_in_flight(sched)))
    # across subnet boundaries: with M = 1 and a window the default cap still fills the pipeline
    for cap in ([1] * P, [2] * P, [min(M, P - s) for s in range(P)]):
        sched = cross_subnet(work, M, 4, cap=cap)
        validate(sched)
        assert all(p <= c for p, c in zip(max_in_flight(sched), cap))
    assert max_in_flight(cross_subnet(work, M, 4, cap=[1] * P)) == (1,) * P


def test_window_fills_the_pipeline_across_subnets() -> None:
    P = 4
    work = [_work([set()] * P) for _ in range(6)]
    assert max(max_in_flight(cross_subnet(work, 1, 1))) == 1  # one micro-batch, flushed: nothing overlaps
    assert max_in_flight(cross_subnet(work, 1, 6)) == tuple(P - s for s in range(P))


# ------------------------------------------------------------------------ the validator


def test_validator_rejects_a_schedule_that_breaks_op_update_order() -> None:
    uses = (({"w"},), ({"w"},))
    good = _subnets(["0F0 0B0 0U 0F0@1 0B0@1 0U@1"], 2, uses)
    assert validate(good) is good
    # subnet 1 reads w before subnet 0 has updated it
    bad = _subnets(["0F0 0B0 0F0@1 0U 0B0@1 0U@1"], 2, uses)
    with pytest.raises(ScheduleError, match="op update order") as info:
        validate(bad)
    msg = str(info.value)
    assert "[0F0@1]" in msg and "[0U]" in msg and "'w'" in msg and "subnet 1" in msg
    # the same with the op on the second of two stages
    uses2 = ((set(), {"w"}), (set(), {"w"}))
    bad2 = _subnets(["0F0 0F0@1 0B0 0U 0B0@1 0U@1", "1F0 1B0 1F0@1 1B0@1 1U@1 1U"], 2, uses2)
    with pytest.raises(ScheduleError, match="op update order"):
        validate(bad2)
    # without a shared op the same interleaving is fine
    free = _subnets(["0F0 0B0 0F0@1 0U 0B0@1 0U@1"], 2, ((set(),), (set(),)))
    assert validate(free) is free


def test_validator_rejects_updates_out_of_subnet_order_for_delayed_ops() -> None:
    uses = (({"w"},), ({"w"},))
    ok = _subnets(["0F0 0F0@1 0B0 0B0@1 0U 0U@1"], 2, uses, delayed=frozenset({"w"}), delay=1)
    assert validate(ok) is ok  # subnet 1 reads the initial w (one update late): it overlaps
    swapped = _subnets(["0F0 0F0@1 0B0 0B0@1 0U@1 0U"], 2, uses, delayed=frozenset({"w"}), delay=1)
    with pytest.raises(ScheduleError, match="op update order"):
        validate(swapped)
    frozen = _subnets(["0F0 0F0@1 0B0 0B0@1 0U@1 0U"], 2, uses, frozen=frozenset({"w"}))
    assert validate(frozen) is frozen  # never updated: no order


def test_delayed_and_frozen_ops_move_between_stages() -> None:
    """A shared op mid-graph changes stage with the subnet: it moves like any op (a state
    message after its previous user's update), and a later subnet reading it without waiting
    for that update still reads it after the first forward of the user it arrived with."""
    uses = (({"w"}, set()), (set(), {"w"}))
    rows = ["0F0 0B0 0U 0F0@1 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"]
    for kw in (dict(delayed=frozenset({"w"}), delay=1), dict(frozen=frozenset({"w"})), {}):
        sch = validate(_subnets(rows, 2, uses, **kw))
        assert [(mv.op, mv.src, mv.dst, str(mv.after)) for mv in sch.rule.moves()] == [("w", 0, 1, "0U")]
    # users on stages 0, 1, 0, 0: subnet 3 reads w (delayed) after subnet 2 brought it back
    uses4 = tuple(({"w"}, set()) if s == 0 else (set(), {"w"}) for s in (0, 1, 0, 0))
    row1 = "1F0 1B0 1U 1F0@1 1B0@1 1U@1 1F0@2 1B0@2 1U@2 1F0@3 1B0@3 1U@3"
    sch = validate(_subnets(["0F0 0B0 0U 0F0@1 0B0@1 0U@1 0F0@2 0B0@2 0F0@3 0B0@3 0U@2 0U@3", row1], 4, uses4,
                            delayed=frozenset({"w"}), delay=1))
    assert Wait(Action(0, "F", 0, 2)) in sch.rule.waits(Action(0, "F", 0, 3))
    overtaking = _subnets(["0F0 0B0 0U 0F0@1 0B0@1 0U@1 0F0@3 0B0@3 0F0@2 0B0@2 0U@2 0U@3", row1], 4, uses4,
                          delayed=frozenset({"w"}), delay=1)
    with pytest.raises(ScheduleError):
        validate(overtaking)


def test_validator_on_cross_subnet_shapes() -> None:
    uses = (({"w"},), ({"w"},))
    with pytest.raises(ScheduleError, match="never runs 0U@1"):
        validate(_subnets(["0F0 0B0 0U 0F0@1 0B0@1"], 2, uses))
    with pytest.raises(ScheduleError, match=r"0U runs before 0B0"):
        validate(_subnets(["0F0 0U 0B0 0F0@1 0B0@1 0U@1"], 2, uses))
    with pytest.raises(ScheduleError, match="subnet 2 is out of range"):
        validate(_subnets(["0F0 0B0 0U 0F0@2 0B0@2 0U@2"], 2, uses))
    with pytest.raises(ScheduleError, match="no update actions"):
        validate(Schedule("x", 1, 1, ((Action.parse("0F0"), Action.parse("0B0"), Action.parse("0F0@1"),
                                       Action.parse("0B0@1")),), num_subnets=2))
    with pytest.raises(ScheduleError, match="ascending micro-batch order"):
        validate(_subnets(["0F1 0F0 0B0 0B1 0U"], 1, (({"w"},),)))
    with pytest.raises(ScheduleError, match="deadlock"):
        # stage 1 runs subnet 1 first; its forward waits for stage 0, which waits for subnet 0's gradient
        validate(_subnets(["0F0 0B0 0F0@1 0U 0B0@1 0U@1", "1F0@1 1B0@1 1F0 1B0 1U 1U@1"], 2, ((set(), set()),) * 2))


def test_cross_subnet_rejects_bad_inputs() -> None:
    with pytest.raises(ScheduleError, match="at least one subnet"):
        cross_subnet([], 1, 1)
    with pytest.raises(ScheduleError, match="pipeline.window"):
        cross_subnet([_work([set()])], 1, 0)
    with pytest.raises(ScheduleError, match="every subnet needs 2 stages"):
        cross_subnet([_work([set(), set()]), _work([set()])], 1, 1)
    with pytest.raises(ScheduleError, match="cap expected 2 values"):
        cross_subnet([_work([set(), set()])], 1, 1, cap=[1])
    with pytest.raises(ScheduleError, match="SubnetWork.fwd"):
        SubnetWork((frozenset(),), (-1.0,), (1.0,))


def test_sequential_runs_each_subnet_flushed_then_its_update() -> None:
    uses = (({"a"}, {"b"}), ({"a"}, {"c"}))
    sch = validate(sequential(one_f_one_b(2, 2), uses))
    assert [" ".join(map(str, row)) for row in sch.actions] == [
        "0F0 0F1 0B0 0B1 0U 0F0@1 0F1@1 0B0@1 0B1@1 0U@1",
        "1F0 1B0 1F1 1B1 1U 1F0@1 1B0@1 1F1@1 1B1@1 1U@1"]
    with pytest.raises(ScheduleError, match="sequential"):
        sequential(sch, uses)


def test_an_arena_bound_keeps_the_subnets_in_flight_within_it() -> None:
    """Disjoint subnets overlap freely; under an arena that holds one subnet's ops per stage,
    a subnet begins on a stage only after the one before is updated there; under one that holds
    two, they overlap again. Every schedule validates."""
    T, P, M = 4, 2, 2
    work = [SubnetWork(tuple({f"op{t}_{s}"} for s in range(P)), (1.0,) * P, (2.0,) * P) for t in range(T)]
    footprint = {f"op{t}_{s}": 60 for t in range(T) for s in range(P)}

    def overlaps(sch: Schedule) -> int:
        n = 0
        for row in sch.actions:
            pos = {a: i for i, a in enumerate(row)}
            n += sum(pos[Action(a.stage, "F", 0, t + 1)] < pos[Action(a.stage, "U", 0, t)]
                     for a in row if a.kind == "U" and (t := a.subnet) + 1 < T)
        return n

    free = validate(cross_subnet(work, M, 3))
    tight = validate(cross_subnet(work, M, 3, arena=ArenaBound((100,) * P, footprint)))
    roomy = validate(cross_subnet(work, M, 3, arena=ArenaBound((120,) * P, footprint)))
    assert overlaps(free) > 0 and overlaps(tight) == 0 and overlaps(roomy) > 0


# ------------------------------------------------------------------ activations capped in bytes


def _held_peak(sched: Schedule, per_microbatch) -> list[int]:
    """Per stage, the most activation bytes held at once along its list (a micro-batch's from its
    forward to its backward, or to its weight gradient when the backward is split)."""
    split = any(a.kind == "W" for row in sched.actions for a in row)
    out = []
    for s, row in enumerate(sched.actions):
        held = peak = 0
        for a in row:
            if a.kind == "F":
                held += per_microbatch[a.subnet][s]
            elif a.kind == ("W" if split else "B"):
                held -= per_microbatch[a.subnet][s]
            peak = max(peak, held)
        out.append(peak)
    return out


@pytest.mark.parametrize("mode,seed", CASES[::4])
@pytest.mark.parametrize("split", [False, True])
def test_equal_footprints_give_the_count_caps_schedule(mode: str, seed: int, split: bool) -> None:
    rng = random.Random(seed * 7 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    P, size = len(work[0].uses), rng.randint(1, 1000)
    caps = ActivationCap.like(stage_caps(P, split), [(size,) * P] * len(work))
    counted = cross_subnet(work, M, window, split=split, **kw)
    assert cross_subnet(work, M, window, split=split, activations=caps, **kw).actions == counted.actions


@pytest.mark.parametrize("mode,seed", CASES[::2])
@pytest.mark.parametrize("split", [False, True])
def test_byte_caps_keep_the_semantics_the_window_and_the_count_caps_peak(mode: str, seed: int, split: bool) -> None:
    """Random footprints per subnet and stage: a valid schedule with the sequential semantics,
    the window kept, and no stage ever holding more bytes than the count cap's worst case."""
    rng = random.Random(seed * 11 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    P = len(work[0].uses)
    per = [tuple(rng.randint(1, 100) for _ in range(P)) for _ in work]
    caps = ActivationCap.like(stage_caps(P, split), per)
    sched = cross_subnet(work, M, window, split=split, activations=caps, **kw)
    assert validate(sched) is sched
    check_sequential_semantics(sched, {op: mode for op in ("stem", "head")}, kw["delay"])
    check_window(sched, window)
    assert all(peak <= cap for peak, cap in zip(_held_peak(sched, per), caps.capacity))


def test_a_stage_holds_more_micro_batches_of_lighter_subnets() -> None:
    """P = 2, M = 4, the last stage slower: 1F1B's cap lets stage 0 hold 2 micro-batches; subnets
    half as heavy there as the heaviest hold 4 in the same bytes, and the run is shorter."""
    P, M = 2, 4
    work = [SubnetWork((frozenset(), frozenset()), (1.0, 2.0), (1.0, 2.0), (0.0,), (0.0, 0.0)) for _ in range(4)]
    per = [(10, 10), (5, 10), (5, 10), (5, 10)]
    counted = cross_subnet(work, M, 4)
    capped = cross_subnet(work, M, 4, activations=ActivationCap.like(stage_caps(P), per))
    assert max_in_flight(counted)[0] == 2 and max_in_flight(capped)[0] == 4
    assert _held_peak(capped, per)[0] <= 20
    assert simulate(capped, work=work).step_time <= simulate(counted, work=work).step_time


def test_a_lone_micro_batch_larger_than_the_cap_still_runs() -> None:
    work = [_work([set(), set()]) for _ in range(2)]
    sched = cross_subnet(work, 2, 2, activations=ActivationCap((5, 5), ((9, 9), (9, 9))))
    assert validate(sched) is sched and max(max_in_flight(sched)) == 1


@pytest.mark.parametrize("bad, field", [
    (dict(capacity=(1, 2, 3), per_microbatch=((1, 1),)), "per_microbatch[0]"),
    (dict(capacity=(1, -2), per_microbatch=((1, 1),)), "capacity"),
    (dict(capacity=(1, 2), per_microbatch=((1.5, 1),)), "per_microbatch[0]"),
])
def test_activation_caps_of_the_wrong_shape_are_named(bad: dict, field: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(f"ActivationCap.{field}:")):
        ActivationCap(**bad)
    with pytest.raises(ScheduleError, match="activations expected 3 subnets x 2 stages"):
        cross_subnet([_work([set(), set()])] * 3, 2, 2, activations=ActivationCap((4, 4), ((1, 1),)))


# ------------------------------------------------------------------------ clipping's norms


@pytest.mark.parametrize("mode,seed", CASES[::4])
def test_with_norms_every_update_follows_every_stages_last_backward(mode: str, seed: int) -> None:
    """``norms`` (train.clip_grad_norm): a stage's update of a subnet comes after the last backward
    of that subnet on every stage with ops to step, and the stage sends its sums right then; the
    builder still keeps the sequential semantics, validates, and its estimates are the simulator's."""
    rng = random.Random(seed * 11 + MODES.index(mode))
    work, M, window, kw = random_instance(rng, mode)
    split = rng.random() < 0.5
    sched, clock = _admit(work, M, window, cap=None, name="cross", split=split, norms=True, **kw)
    assert validate(sched) is sched and sched.norms
    check_sequential_semantics(sched, {op: mode for op in ("stem", "head")}, kw["delay"])
    check_window(sched, window)
    r = simulate(sched, work=work, state_time=kw["state_time"])
    span = {sp.action: sp for row in r.timeline for sp in row}
    assert r.step_time == max(clock.end)
    P, rule, last = sched.num_stages, sched.rule, "W" if split else "B"
    for t in range(sched.num_subnets):
        for s in range(P):
            norms = [w for w in rule.waits(Action(s, "U", 0, t)) if w.message == "norm"]
            senders = [s2 for s2 in range(P) if s2 != s and rule.stepped(t, s2)] if rule.stepped(t, s) else []
            assert [w.action for w in norms] == [Action(s2, last, M - 1, t) for s2 in senders]
            for w in norms:
                assert span[Action(s, "U", 0, t)].start >= span[w.action].end - 1e-12
                assert (s, w) in rule.sends(w.action)
    unclipped = cross_subnet(work, M, window, split=split, **kw)
    assert not any(w.message == "norm" for s in range(P) for a in unclipped.actions[s]
                   for w in unclipped.rule.waits(a))


def test_flushed_steps_with_norms_keep_their_order_and_send_one_norm_per_stage_pair() -> None:
    P, M, T = 3, 4, 2
    uses = [{f"w{s}"} for s in range(P)]
    base = one_f_one_b(P, M)
    plain = sequential(base, [uses] * T)
    sched = validate(sequential(base, [uses] * T, norms=True))
    assert sched.actions == plain.actions and sched.norms
    for src in range(P):
        for dst in range(P):
            if src != dst:
                norms = [w for w in sched.rule.channel(sched.actions, src, dst) if w.message == "norm"]
                assert [w.action for w in norms] == [Action(src, "B", M - 1, t) for t in range(T)]
    # a stage whose subnet steps nothing (no ops with state, or only frozen ones) neither sends nor waits
    frozen = validate(sequential(base, [[{"w0"}, {"f"}, set()]], frozen=frozenset({"f"}), norms=True))
    waits = {s: [w for w in frozen.rule.waits(Action(s, "U", 0, 0)) if w.message == "norm"] for s in range(P)}
    assert waits == {0: [], 1: [], 2: []}
    with pytest.raises(ScheduleError, match="Schedule.norms"):
        Schedule("x", 1, 1, ((Action(0, "F", 0), Action(0, "B", 0)),), norms=True)
