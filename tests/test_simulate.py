"""The simulator: closed forms for uniform costs, link queueing, slow stages, memory, determinism."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.plan.schedule import Action, Schedule, ScheduleError, forward_only, gpipe, max_in_flight, one_f_one_b
from pipeline.plan.simulate import SimulationError, simulate
from test_schedule import _subnets

SIZES = list(itertools.product(range(1, 7), range(1, 11)))


@pytest.mark.parametrize("P,M", SIZES)
def test_uniform_costs_closed_form(P: int, M: int) -> None:
    f, b = 1.5, 2.5  # exactly representable: sums are exact
    for build in (gpipe, one_f_one_b):
        r = simulate(build(P, M), [f] * P, [b] * P, [0.0] * (P - 1))
        assert r.step_time == (M + P - 1) * (f + b)
        assert r.bubble_fraction == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)
        assert r.busy == (M * (f + b),) * P


@pytest.mark.parametrize("P,M", SIZES)
def test_timeline_respects_dependencies(P: int, M: int) -> None:
    rng = np.random.default_rng(P * 100 + M)
    fwd, bwd = rng.uniform(0.5, 2, P), rng.uniform(0.5, 3, P)
    send, gsend = rng.uniform(0, 1, P - 1), rng.uniform(0, 1, P - 1)
    for build in (gpipe, one_f_one_b):
        sched = build(P, M)
        r = simulate(sched, fwd, bwd, send, grad_send_time=gsend)
        span = {sp.action: sp for row in r.timeline for sp in row}
        for s, row in enumerate(r.timeline):
            assert [sp.action for sp in row] == list(sched.actions[s])
            for prev, sp in zip(row, row[1:]):
                assert sp.start >= prev.end  # one action at a time, in order
            for sp in row:
                a = sp.action
                assert sp.end - sp.start == pytest.approx(fwd[s] if a.kind == "F" else bwd[s])
                if a.kind == "F" and s > 0:
                    assert sp.start >= span[Action(s - 1, "F", a.microbatch)].end + send[s - 1] - 1e-12
                if a.kind == "B" and s < P - 1:
                    assert sp.start >= span[Action(s + 1, "B", a.microbatch)].end + gsend[s] - 1e-12
        assert r.step_time == max(sp.end for row in r.timeline for sp in row)
        assert r.bubble_fraction == pytest.approx(1 - sum(r.busy) / (P * r.step_time))
        assert r.peak_in_flight == max_in_flight(sched)


def test_transfer_latency_two_stages() -> None:
    f, b, t = 1.0, 2.0, 0.25
    r = simulate(gpipe(2, 1), [f, f], [b, b], [t])
    assert r.step_time == 2 * f + 2 * b + 2 * t
    r = simulate(gpipe(2, 1), [f, f], [b, b], [t], grad_send_time=[1.0])
    assert r.step_time == 2 * f + 2 * b + t + 1.0


def test_link_is_a_fifo_resource() -> None:
    # stage 0 forwards instantly; each activation occupies the link for 1.0, so they arrive at 1, 2, 3
    r = simulate(forward_only(2, 3), [0.0, 0.1], [0.0, 0.0], [1.0])
    starts = [sp.start for sp in r.timeline[1]]
    assert starts == [1.0, 2.0, 3.0]
    assert r.step_time == pytest.approx(3.1)


def test_zero_compute_is_pure_transfer() -> None:
    sends = [0.5, 0.25, 1.0]
    r = simulate(gpipe(4, 1), [0.0] * 4, [0.0] * 4, sends)
    assert r.step_time == 2 * sum(sends)
    assert r.bubble_fraction == 1.0  # no stage is ever busy
    assert r.peak_in_flight == (1, 1, 1, 1)  # zero-length F then B still holds the micro-batch


def test_slow_stage_dominates() -> None:
    P, M = 4, 8
    fwd, bwd = [1.0, 1.0, 5.0, 1.0], [2.0, 2.0, 10.0, 2.0]
    for build in (gpipe, one_f_one_b):
        r = simulate(build(P, M), fwd, bwd, [0.0] * (P - 1))
        slow = M * (fwd[2] + bwd[2])
        assert slow <= r.step_time <= slow + sum(f + b for k, (f, b) in enumerate(zip(fwd, bwd)) if k != 2)
        assert r.busy[2] == slow
        assert max(r.busy) == r.busy[2]


@pytest.mark.parametrize("P,M", [(1, 1), (2, 5), (4, 3), (4, 8), (6, 10)])
def test_peak_memory(P: int, M: int) -> None:
    static = [float(10 * (s + 1)) for s in range(P)]
    act = [3.0] * P
    r = simulate(one_f_one_b(P, M), [1.0] * P, [2.0] * P, [0.1] * (P - 1), static_bytes=static, act_bytes=act)
    assert r.peak_memory == tuple(static[s] + min(M, P - s) * 3.0 for s in range(P))
    r = simulate(gpipe(P, M), [1.0] * P, [2.0] * P, [0.1] * (P - 1), static_bytes=static, act_bytes=act)
    assert r.peak_memory == tuple(static[s] + M * 3.0 for s in range(P))
    assert simulate(gpipe(P, M), [1.0] * P, [2.0] * P, [0.1] * (P - 1)).peak_memory is None


def test_deterministic() -> None:
    rng = np.random.default_rng(7)
    args = (one_f_one_b(5, 7), rng.uniform(0, 1, 5), rng.uniform(0, 2, 5), rng.uniform(0, 0.3, 4))
    assert simulate(*args) == simulate(*args)


def test_rejects_bad_costs_and_schedules() -> None:
    with pytest.raises(SimulationError, match=r"fwd_time: expected 3 values"):
        simulate(gpipe(3, 2), [1.0, 1.0], [1.0] * 3, [0.0] * 2)
    with pytest.raises(SimulationError, match=r"send_time: expected 2 values"):
        simulate(gpipe(3, 2), [1.0] * 3, [1.0] * 3, [0.0] * 3)
    with pytest.raises(SimulationError, match=r"bwd_time\[1\]"):
        simulate(gpipe(3, 2), [1.0] * 3, [1.0, -1.0, 1.0], [0.0] * 2)
    bad = Schedule("bad", 2, 1, ((Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0), Action(1, "B", 0))))
    with pytest.raises(ScheduleError, match=r"\[0B0\]"):
        simulate(bad, [1.0] * 2, [1.0] * 2, [0.0])


# ------------------------------------------------------------------------------ host channels


def _links(P: int, h2d: float = 1.0, d2h: float = 1.0, host: float | None = None, **free):
    from pipeline.plan.simulate import HostLinks
    return HostLinks((h2d,) * P, (d2h,) * P, None if host is None else (host,) * P, **free)


@pytest.mark.parametrize("P,M", [(1, 1), (2, 3), (3, 4), (4, 8)])
def test_no_copies_changes_nothing(P: int, M: int) -> None:
    rng = np.random.default_rng(P * 10 + M)
    fwd, bwd, send = rng.uniform(0.5, 2, P), rng.uniform(0.5, 3, P), rng.uniform(0, 1, P - 1)
    for build in (gpipe, one_f_one_b):
        plain = simulate(build(P, M), fwd, bwd, send)
        with_links = simulate(build(P, M), fwd, bwd, send, copies=[], links=_links(P))
        assert with_links.timeline == plain.timeline and with_links.step_time == plain.step_time
        assert with_links.stall == (0.0,) * P and plain.copies is None and plain.stall is None


def test_late_fetch_is_a_stall_that_shifts_the_step() -> None:
    from pipeline.plan.simulate import Copy
    P, M, f, b = 2, 4, 1.0, 2.0
    sched = one_f_one_b(P, M)
    base = simulate(sched, [f] * P, [b] * P, [0.0])
    # stage 1's op arrives 3 s into the step: stage 1 could start its first F at 1 s
    late = simulate(sched, [f] * P, [b] * P, [0.0], links=_links(P, h2d=2.0),
                    copies=[Copy(1, "h2d", 6.0, ready=0.0, before=Action(1, "F", 0))])
    assert late.copies[0].start == 0.0 and late.copies[0].end == 3.0
    assert late.stall == (0.0, 2.0)
    assert late.step_time > base.step_time
    # issued early enough during the step before, the same fetch hides completely
    early = simulate(sched, [f] * P, [b] * P, [0.0], links=_links(P, h2d=2.0),
                     copies=[Copy(1, "h2d", 6.0, ready=-5.0, before=Action(1, "F", 0))])
    assert early.stall == (0.0, 0.0) and early.step_time == base.step_time


def test_channels_are_fifo_and_directions_independent() -> None:
    from pipeline.plan.simulate import Copy
    sched = gpipe(1, 1)
    r = simulate(sched, [1.0], [1.0], [], links=_links(1, h2d=1.0, d2h=1.0), copies=[
        Copy(0, "h2d", 2.0, ready=0.0, label="a"), Copy(0, "h2d", 1.0, ready=0.0, before=Action(0, "F", 0)),
        Copy(0, "d2h", 4.0, ready=0.0)])
    assert [(c.start, c.end) for c in r.copies] == [(0.0, 2.0), (2.0, 3.0), (0.0, 4.0)]
    assert r.stall == (3.0,) and r.step_time == 5.0
    assert r.free_at["h2d"] == (3.0,) and r.free_at["d2h"] == (4.0,)
    # a channel still busy from the step before delays this step's copies
    r = simulate(sched, [1.0], [1.0], [], links=_links(1, h2d_free_at=(1.5,)),
                 copies=[Copy(0, "h2d", 1.0, before=Action(0, "F", 0))])
    assert r.copies[0].start == 1.5 and r.stall == (2.5,)


def test_writeback_then_fetch_and_the_host_update() -> None:
    from pipeline.plan.simulate import Copy
    P, M = 2, 2
    sched = one_f_one_b(P, M)
    last_b = Action(0, "B", M - 1)
    copies = [
        Copy(0, "d2h", 4.0, after=last_b, label="grads"),           # 0: grads down after the last backward
        Copy(0, "host", 8.0, waits_for=(0,), label="update"),       # 1: the host's update after them
        Copy(0, "h2d", 2.0, waits_for=(1,), label="weights"),       # 2: the new weights after the update
        Copy(0, "d2h", 2.0, ready=0.0, label="evict"),               # 3: a write-back...
        Copy(0, "h2d", 2.0, waits_for=(3,), label="into its space"),  # 4: ...then a fetch into its space
    ]
    r = simulate(sched, [1.0] * P, [1.0] * P, [0.0], links=_links(P, 2.0, 2.0, host=4.0), copies=copies)
    end_b = next(sp.end for sp in r.timeline[0] if sp.action == last_b)
    c = r.copies
    assert c[0].start == end_b and c[0].end == end_b + 2.0
    assert c[1].start == c[0].end and c[1].end == c[1].start + 2.0
    assert c[2].start == c[1].end and c[2].end > r.step_time  # finishes after the step: carried over
    # each channel is FIFO in list order: the write-back waits behind the grads on d2h, and the
    # fetch into its space behind the new weights on h2d
    assert c[3].start == c[0].end and c[3].end == c[3].start + 1.0
    assert c[4].start == max(c[3].end, c[2].end)
    assert r.stall == (0.0, 0.0) and r.free_at["host"][0] == c[1].end


def test_peer_copies_out_after_forward_back_before_backward() -> None:
    """The peer tier's copies: out on ``peer_out`` after a forward, back on ``peer_in`` before the
    backward; a slow peer link stalls the backward it feeds, a fast one hides."""
    from pipeline.plan.simulate import Copy, HostLinks
    P, M, f, b = 2, 2, 1.0, 2.0
    sched = one_f_one_b(P, M)
    base = simulate(sched, [f] * P, [b] * P, [0.0])

    def run(rate: float):
        copies = []
        for m in range(M):
            copies.append(Copy(0, "peer_out", 4.0, after=Action(0, "F", m), label=f"out {m}"))
            copies.append(Copy(0, "peer_in", 4.0, waits_for=(len(copies) - 1,), before=Action(0, "B", m),
                               label=f"in {m}"))
        links = HostLinks((1.0,) * P, (1.0,) * P, peer_out=(rate, 1.0), peer_in=(rate, 1.0))
        return simulate(sched, [f] * P, [b] * P, [0.0], copies=copies, links=links)

    slow, fast = run(1.0), run(1e9)
    assert slow.copies[0].start == 1.0 and slow.copies[1].start == slow.copies[0].end == 5.0
    assert slow.stall[0] > 0 and slow.step_time > base.step_time and slow.free_at["peer_in"][0] > 0
    assert fast.stall == (0.0, 0.0) and fast.step_time == base.step_time
    with pytest.raises(SimulationError, match="HostLinks.peer_in is None"):
        simulate(sched, [f] * P, [b] * P, [0.0], links=_links(P), copies=[Copy(0, "peer_in", 1.0)])


def test_copy_errors() -> None:
    from pipeline.plan.simulate import Copy
    sched = gpipe(1, 1)
    with pytest.raises(SimulationError, match="wait for each other"):
        simulate(sched, [1.0], [1.0], [], links=_links(1),
                 copies=[Copy(0, "h2d", 1.0, after=Action(0, "F", 0), before=Action(0, "F", 0))])
    with pytest.raises(SimulationError, match="channel: expected one of"):
        simulate(sched, [1.0], [1.0], [], links=_links(1), copies=[Copy(0, "pcie", 1.0)])
    with pytest.raises(SimulationError, match="HostLinks.host is None"):
        simulate(sched, [1.0], [1.0], [], links=_links(1), copies=[Copy(0, "host", 1.0)])
    with pytest.raises(SimulationError, match="waits_for: expected indices of earlier copies"):
        simulate(sched, [1.0], [1.0], [], links=_links(1), copies=[Copy(0, "h2d", 1.0, waits_for=(0,))])


# ------------------------------------------------------------------ cross-subnet schedules

from pipeline.plan.simulate import makespan  # noqa: E402


def _cross(rows: list[str], uses, **kw) -> Schedule:
    return _subnets(rows, len(uses), uses, **kw)


def _work(P: int, fwd, bwd, send=None, update=None, uses=None):
    from pipeline.plan.admission import SubnetWork
    return SubnetWork(uses or (frozenset(),) * P, fwd, bwd, send or (0.0,) * (P - 1), update or (0.0,) * P)


def test_per_subnet_costs_updates_and_losses() -> None:
    # P=2, M=1, two subnets sharing op w on stage 1: each stage in turn, update last
    uses = ((frozenset(), frozenset({"w"})),) * 2
    sched = _cross(["0F0 0B0 0U 0F0@1 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"], uses)
    work = [_work(2, (1.0, 2.0), (3.0, 4.0), (0.5,), (0.25, 0.75)), _work(2, (2.0, 1.0), (1.0, 1.0), (0.0,), (1.0, 1.0))]
    r = simulate(sched, work=work)
    span = {sp.action: (sp.start, sp.end) for row in r.timeline for sp in row}
    A = Action.parse
    assert span[A("0F0")] == (0.0, 1.0)
    assert span[A("1F0")] == (1.5, 3.5)           # after the activation's 0.5 s on the link
    assert span[A("1B0")] == (3.5, 7.5)
    assert span[A("1U")] == (7.5, 8.25)
    assert span[A("0B0")] == (8.0, 11.0)          # the gradient's 0.5 s
    assert span[A("0U")] == (11.0, 11.25)         # after its backward and the losses (1U ended at 8.25)
    assert span[A("0F0@1")] == (11.25, 13.25)     # stage 0 is free: nothing of subnet 1 waits there
    assert span[A("1F0@1")] == (13.25, 14.25)     # reads w after 1U: the activation comes later
    assert r.step_time == span[A("0U@1")][1] == max(e for _, e in span.values())
    assert r.busy == (1 + 3 + 0.25 + 2 + 1 + 1, 2 + 4 + 0.75 + 1 + 1 + 1)
    assert makespan(sched, work=work) == r.step_time
    assert r.peak_in_flight == max_in_flight(sched) == (1, 1)  # updates hold no micro-batch


def test_an_op_move_takes_its_state_time_after_the_update_it_follows() -> None:
    uses = ((frozenset({"a"}), frozenset()), (frozenset(), frozenset({"a"})))
    sched = _cross(["0F0 0B0 0U 0F0@1 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"], uses)
    work = [_work(2, (1.0, 1.0), (1.0, 1.0))] * 2
    r = simulate(sched, work=work, state_time={"a": 10.0})
    span = {sp.action: sp for row in r.timeline for sp in row}
    assert span[Action(1, "F", 0, 1)].start == span[Action(0, "U", 0, 0)].end + 10.0
    assert simulate(sched, work=work).step_time < r.step_time  # moves free without state_time
    # from an origin elsewhere, the first user waits for the move from the start
    moved = _cross(["0F0 0B0 0U 0F0@1 0B0@1 0U@1", "1F0 1B0 1U 1F0@1 1B0@1 1U@1"], uses, origin={"a": 1})
    r = simulate(moved, work=work, state_time={"a": 3.0})
    assert r.timeline[0][0].start == 3.0
    assert makespan(moved, work=work, state_time={"a": 3.0}) == r.step_time


def test_per_stage_costs_on_a_cross_subnet_schedule_charge_every_subnet_alike() -> None:
    from pipeline.plan.admission import cross_subnet
    P, M, T = 3, 2, 4
    work = [_work(P, (1.0,) * P, (2.0,) * P, uses=tuple(frozenset({f"w{s}"}) for s in range(P)))] * T
    sched = cross_subnet(work, M, 2)
    per_stage = simulate(sched, [1.0] * P, [2.0] * P, [0.0] * (P - 1))
    per_subnet = simulate(sched, work=work)
    assert per_stage.timeline == per_subnet.timeline
    # window 1 with equal costs: T flushed 1F1B steps back to back (updates free)
    flushed = cross_subnet(work, M, 1)
    assert simulate(flushed, work=work).step_time == T * simulate(one_f_one_b(P, M), [1.0] * P, [2.0] * P,
                                                                  [0.0] * (P - 1)).step_time


@pytest.mark.parametrize("seed", range(30))
def test_cross_subnet_timeline_respects_every_wait(seed: int) -> None:
    from pipeline.plan.admission import SubnetWork, cross_subnet
    rng = np.random.default_rng(seed)
    P, M, T = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 6))
    ops = [f"o{k}" for k in range(4)]
    work = []
    for _ in range(T):
        uses = [set() for _ in range(P)]
        for op in ops:
            if rng.random() < 0.6:
                uses[int(rng.integers(P))].add(op)
        work.append(SubnetWork(tuple(frozenset(u) for u in uses), tuple(rng.uniform(0.1, 2, P)),
                               tuple(rng.uniform(0.1, 2, P)), tuple(rng.uniform(0, 0.5, P - 1)),
                               tuple(rng.uniform(0, 0.3, P))))
    state = {op: float(rng.uniform(0, 2)) for op in ops}
    sched = cross_subnet(work, M, int(rng.integers(1, T + 1)), state_time=state)
    r = simulate(sched, work=work, state_time=state)
    span = {sp.action: sp for row in r.timeline for sp in row}
    for s, row in enumerate(r.timeline):
        for prev, sp in zip(row, row[1:]):
            assert sp.start >= prev.end
        for sp in row:
            a, w = sp.action, work[sp.action.subnet]
            assert sp.end - sp.start == pytest.approx({"F": w.fwd, "B": w.bwd, "U": w.update}[a.kind][s])
            for wait in sched.rule.waits(a):
                if wait.action is None:
                    assert sp.start >= state[wait.op] - 1e-12
                    continue
                arrive = span[wait.action].end + {"activation": w.send[s - 1] if s else 0.0,
                                                  "gradient": w.send[s] if s < P - 1 else 0.0,
                                                  "state": state.get(wait.op or "", 0.0)}.get(wait.message, 0.0)
                assert sp.start >= arrive - 1e-12, (a, wait)
    assert r.peak_in_flight == max_in_flight(sched)
    assert makespan(sched, work=work, state_time=state) == r.step_time


def test_copies_on_a_cross_subnet_schedule() -> None:
    from pipeline.plan.simulate import Copy
    uses = ((frozenset(),), (frozenset(),))
    sched = _cross(["0F0 0B0 0U 0F0@1 0B0@1 0U@1"], uses)
    work = [_work(1, (1.0,), (1.0,))] * 2
    r = simulate(sched, work=work, links=_links(1, h2d=1.0),
                 copies=[Copy(0, "h2d", 5.0, ready=0.0, before=Action(0, "F", 0, 1))])
    assert r.stall == (3.0,) and r.step_time == 7.0


def test_cost_arguments_are_one_way_or_the_other() -> None:
    sched = gpipe(2, 1)
    with pytest.raises(SimulationError, match="not both"):
        simulate(sched, [1.0] * 2, [1.0] * 2, [0.0], work=[_work(2, (1.0, 1.0), (1.0, 1.0))])
    with pytest.raises(SimulationError, match="found neither"):
        simulate(sched)
    with pytest.raises(SimulationError, match=r"work: expected one SubnetWork per subnet .* \(1\), found 2"):
        simulate(sched, work=[_work(2, (1.0, 1.0), (1.0, 1.0))] * 2)
    with pytest.raises(SimulationError, match=r"work\[0\]: expected costs for 2 stages, found 3"):
        simulate(sched, work=[_work(3, (1.0,) * 3, (1.0,) * 3)])
    with pytest.raises(SimulationError, match="state_time: per-op move seconds go with per-subnet costs"):
        simulate(sched, [1.0] * 2, [1.0] * 2, [0.0], state_time={"a": 1.0})
    with pytest.raises(SimulationError, match=r"state_time\['a'\]"):
        simulate(sched, work=[_work(2, (1.0, 1.0), (1.0, 1.0))], state_time={"a": -1.0})
