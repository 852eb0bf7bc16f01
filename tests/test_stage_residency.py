"""The tensor manager's decisions over a cross-subnet schedule, planned per stage and replayed (pure)."""
from __future__ import annotations

import math
import random

import pytest

from pipeline.plan.admission import ArenaBound, SubnetWork, cross_subnet
from pipeline.plan.schedule import Action
from pipeline.plan.simulate import HostLinks, simulate
from pipeline.plan.stage_residency import StageResidencyError, plan_stage, residency_copies

P, M = 2, 2


def _stream(T: int, seed: int, layers: int = 4, choices: int = 3):
    """``T`` subnets on ``P`` stages: per stage ``layers`` choice layers of ``choices`` candidates
    (op ``s.l.c``), a shared op per stage; sizes 10 + c bytes."""
    rng = random.Random(seed)
    uses = [tuple(frozenset({f"shared{s}"} | {f"{s}.{k}.{rng.randrange(choices)}" for k in range(layers)})
                  for s in range(P)) for _ in range(T)]
    work = [SubnetWork(u, (1.0,) * P, (2.0,) * P, (0.1,) * (P - 1), (0.5,) * P) for u in uses]
    sizes = {op: 10 + int(op[-1]) if "." in op else 5 for u in uses for ops in u for op in ops}
    return work, sizes


def _schedule(work, sizes, window: int = 3, capacity: int | None = None, **kw):
    arena = None if capacity is None else ArenaBound((capacity,) * P, sizes)
    return cross_subnet(work, M, window, delayed=frozenset({"shared0", "shared1"}), delay=window - 1, arena=arena,
                        **kw)


@pytest.mark.parametrize("policy", ["belady", "lru", "on_demand"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_arena_is_never_exceeded_and_every_use_is_counted_once(policy: str, seed: int) -> None:
    work, sizes = _stream(24, seed)
    capacity = 2 * max(sum(sizes[o] for o in w.uses[s]) for w in work for s in range(P)) + 7
    sched = _schedule(work, sizes, capacity=capacity)
    for s in range(P):
        plan = plan_stage(sched, s, sizes, capacity, policy, prefetch_depth=2)
        assert plan.peak_bytes <= capacity
        assert all(ev.used_bytes <= capacity and ev.peak_bytes <= capacity for ev in plan.events)
        assert plan.uses == sum(len(w.uses[s]) for w in work)
        assert plan.hits + plan.prefetched + plan.misses == plan.uses
        begins = [ev for ev in plan.events if ev.kind == "begin"]
        firsts = [a.subnet for a in sched.actions[s] if a.kind == "F" and a.microbatch == 0]
        assert [ev.subnet for ev in begins] == firsts
        for ev in begins:  # the subnet's ops are all accounted for when it begins
            assert set(ev.hits) | set(ev.prefetched) | {f.op for f in ev.fetches} == work[ev.subnet].uses[s]
        if policy == "on_demand":
            assert plan.prefetched == 0 and all(not ev.fetches for ev in plan.events if ev.kind != "begin")
        # a fetch ahead is for a subnet that has not begun yet
        begun: set[int] = set()
        for ev in plan.events:
            if ev.kind == "begin":
                begun.add(ev.subnet)
            else:
                assert all(f.subnet not in begun for f in ev.fetches)


def test_an_arena_that_holds_everything_fetches_each_op_once() -> None:
    work, sizes = _stream(12, 3)
    sched = _schedule(work, sizes)
    for s in range(P):
        plan = plan_stage(sched, s, sizes, 10**9, "belady", prefetch_depth=2)
        ops = set().union(*(w.uses[s] for w in work))
        assert plan.fetched_bytes == sum(sizes[o] for o in ops) and plan.written_bytes == 0
        assert plan.hits == plan.uses - len(ops)


def test_a_bound_the_admission_did_not_keep_is_an_error() -> None:
    work, sizes = _stream(8, 0)
    sched = _schedule(work, sizes)  # no arena bound: several subnets pinned at once
    one = max(sum(sizes[o] for o in w.uses[0]) for w in work)
    with pytest.raises(StageResidencyError, match="admission"):
        plan_stage(sched, 0, sizes, one, "belady")


def test_free_copies_replay_the_all_resident_schedule_exactly() -> None:
    work, sizes = _stream(16, 4)
    capacity = 3 * max(sum(sizes[o] for o in w.uses[s]) for w in work for s in range(P))
    sched = _schedule(work, sizes, capacity=capacity)
    base = simulate(sched, work=work)
    plans = [plan_stage(sched, s, sizes, capacity, "belady") for s in range(P)]
    free = HostLinks((math.inf,) * P, (math.inf,) * P, (1.0,) * P)
    r = simulate(sched, work=work, copies=residency_copies(sched, plans), links=free)
    assert r.step_time == base.step_time and r.waited == {} and sum(r.stall) == 0.0


def test_a_slow_link_stalls_first_forwards_and_the_waits_add_up() -> None:
    work, sizes = _stream(16, 5)
    capacity = 2 * max(sum(sizes[o] for o in w.uses[s]) for w in work for s in range(P))
    sched = _schedule(work, sizes, capacity=capacity)
    base = simulate(sched, work=work)
    plans = [plan_stage(sched, s, sizes, capacity, "belady") for s in range(P)]
    for duplex in (False, True):
        copies = residency_copies(sched, plans, duplex=duplex)
        assert {c.channel for c in copies} <= ({"h2d", "d2h"} if duplex else {"h2d"})
        r = simulate(sched, work=work, copies=copies, links=HostLinks((20.0,) * P, (20.0,) * P, (1.0,) * P))
        assert r.step_time > base.step_time and r.waited
        assert all(a.kind == "F" and a.microbatch == 0 for a in r.waited)  # nothing moves: only fetches wait
        for s in range(P):
            assert sum(w for a, w in r.waited.items() if a.stage == s) == pytest.approx(r.stall[s])


def test_a_moving_op_is_fetched_where_it_lands_and_written_back_where_it_leaves() -> None:
    # op "x" runs on stage 0 for subnet 0 and on stage 1 for subnet 1: it moves after 0U@0
    uses = [(frozenset({"x", "a"}), frozenset({"b"})), (frozenset({"a"}), frozenset({"x", "b"}))]
    work = [SubnetWork(u, (1.0,) * P, (2.0,) * P, (0.1,), (0.5,) * P) for u in uses]
    sizes = {"x": 8, "a": 4, "b": 4}
    sched = cross_subnet(work, M, 1, origin={"x": 0, "a": 0, "b": 1}, state_time={"x": 0.2})
    src, dst = plan_stage(sched, 0, sizes, 100, adopt="host"), plan_stage(sched, 1, sizes, 100, adopt="host")
    (end0,) = [ev for ev in src.events if ev.kind == "end" and ev.subnet == 0]
    assert end0.leave == (("x", 8),)  # changed on the device: written back before it is sent
    (begin1,) = [ev for ev in dst.events if ev.kind == "begin" and ev.subnet == 1]
    assert [f.op for f in begin1.fetches] == ["x"]  # adopted into a host home: fetched on demand
    assert all(f.op != "x" for ev in dst.events if ev.kind != "begin" for f in ev.fetches)  # never ahead of arrival
    copies = residency_copies(sched, [src, dst])
    (export,) = [c for c in copies if c.label == "export x"]
    assert export.after == Action(0, "U", 0, 0) and export.before == Action(0, "F", 0, 1)
    # the runtime now: the state lands in the arena and leaves from it, no host copy either side
    src_d, dst_d = plan_stage(sched, 0, sizes, 100), plan_stage(sched, 1, sizes, 100)
    assert dict(next(ev for ev in src_d.events if ev.kind == "end" and ev.subnet == 0).leave) == {"x": 0}
    assert dst_d.arrived == 1 and dst_d.hits + dst_d.prefetched + dst_d.misses + dst_d.arrived == dst_d.uses
    assert all(f.op != "x" for ev in dst_d.events for f in ev.fetches)


def test_an_op_that_leaves_and_comes_back_is_owned_in_between_only() -> None:
    # "x": stage 0 (subnet 0), stage 1 (subnet 1), stage 0 again (subnet 2)
    uses = [(frozenset({"x"}), frozenset({"b"})), (frozenset({"a"}), frozenset({"x"})),
            (frozenset({"x"}), frozenset({"b"}))]
    work = [SubnetWork(u, (1.0,) * P, (2.0,) * P, (0.1,), (0.5,) * P) for u in uses]
    sizes = {"x": 8, "a": 4, "b": 4}
    sched = cross_subnet(work, M, 1, origin={"x": 0, "a": 0, "b": 1})
    plan = plan_stage(sched, 0, sizes, 100, prefetch_depth=2, adopt="host")
    start = plan.events[0]
    assert start.kind == "start" and [f.op for f in start.fetches] == ["x", "a"]  # owned at the start: ahead
    (back,) = [ev for ev in plan.events if ev.kind == "begin" and ev.subnet == 2]
    assert [f.op for f in back.fetches] == ["x"]  # it came back in a host home: on demand
    plan = plan_stage(sched, 0, sizes, 100, prefetch_depth=2)  # into the arena: no fetch at all
    assert plan.arrived == 1 and all(f.op != "x" for ev in plan.events[1:] for f in ev.fetches)


def test_an_arrival_evicts_as_a_fetch_ahead_would() -> None:
    # "x" arrives on stage 1 for subnet 1 into a full arena: "b" (used) and "c" (fetched ahead for
    # subnet 2). Belady gives "c" up (needed later) and "x" lands in the arena; LRU keeps ops
    # fetched ahead from a fetch that is not on demand, so "x" lands at home and its use fetches it
    uses = [(frozenset({"x"}), frozenset({"b"})), (frozenset({"a"}), frozenset({"x"})),
            (frozenset({"a"}), frozenset({"c"}))]
    work = [SubnetWork(u, (1.0,) * P, (2.0,) * P, (0.1,), (0.5,) * P) for u in uses]
    sizes = {"x": 8, "a": 4, "b": 4, "c": 4}
    sched = cross_subnet(work, M, 1, origin={"x": 0, "a": 0, "b": 1, "c": 1})
    belady, lru = plan_stage(sched, 1, sizes, 8), plan_stage(sched, 1, sizes, 8, "lru")
    assert belady.arrived == 1 and all(f.op != "x" for ev in belady.events for f in ev.fetches)
    (begin1,) = [ev for ev in lru.events if ev.kind == "begin" and ev.subnet == 1]
    assert lru.arrived == 0 and [f.op for f in begin1.fetches] == ["x"]


def test_the_horizon_looks_past_the_subnets_in_flight() -> None:
    # the store looks prefetch_depth + 1 pending subnets past those in flight; counting those in
    # flight among them (the runtime before), a shallow horizon fetches less ahead
    work, sizes = _stream(12, 6, layers=2, choices=12)
    sched = _schedule(work, sizes, window=4)
    shallow = plan_stage(sched, 0, sizes, 10**9, "belady", prefetch_depth=0, past_in_flight=False)
    deep = plan_stage(sched, 0, sizes, 10**9, "belady", prefetch_depth=6, past_in_flight=False)
    assert deep.prefetched > shallow.prefetched and deep.misses < shallow.misses
    past = plan_stage(sched, 0, sizes, 10**9, "belady", prefetch_depth=0)
    assert past.prefetched > shallow.prefetched and past.misses < shallow.misses


def test_bad_inputs_name_what_was_expected() -> None:
    work, sizes = _stream(4, 0)
    sched = _schedule(work, sizes)
    with pytest.raises(StageResidencyError, match="prefetch_depth"):
        plan_stage(sched, 0, sizes, 10**9, prefetch_depth=-1)
    with pytest.raises(StageResidencyError, match="adopt"):
        plan_stage(sched, 0, sizes, 10**9, adopt="gpu")
    with pytest.raises(StageResidencyError, match="sizes"):
        plan_stage(sched, 0, {}, 10**9)
    with pytest.raises(ValueError, match="policy"):
        plan_stage(sched, 0, sizes, 10**9, policy="fifo")


# -- hybrid optimizer placement (``weights``: the runtime's default, memory.optimizer=hybrid) --------

def _hybrid_case():
    # stage 0: "a" runs in subnets 0 and 1 (the next subnet reuses it at 0: its state comes along),
    # "x" in 0 and 2 (never by the next one: weights alone, the host steps it), "y" in 1, "b" in 2
    uses = [(frozenset({"a", "x"}), frozenset({"c"})), (frozenset({"a", "y"}), frozenset({"c"})),
            (frozenset({"b", "x"}), frozenset({"c"}))]
    work = [SubnetWork(u, (1.0,) * P, (2.0,) * P, (0.1,), (0.5,) * P) for u in uses]
    sizes = {"a": 10, "x": 10, "y": 10, "b": 10, "c": 10}
    weights = {op: 4 for op in sizes}
    sched = cross_subnet(work, M, 1, origin={"a": 0, "x": 0, "y": 0, "b": 0, "c": 1})
    return work, sizes, weights, sched


def test_hybrid_keeps_the_state_only_where_the_next_subnet_reuses_the_op() -> None:
    work, sizes, weights, sched = _hybrid_case()
    plan = plan_stage(sched, 0, sizes, 100, "belady", prefetch_depth=0, weights=weights)
    fetched = [(f.op, f.subnet, f.nbytes) for ev in plan.events for f in ev.fetches]
    assert sorted(fetched) == [("a", 0, 10), ("b", 2, 4), ("x", 0, 4), ("x", 2, 4), ("y", 1, 4)]
    ends = {ev.subnet: ev.host_updates for ev in plan.events if ev.kind == "end"}
    # "a" is still resident with its state at subnet 1 (no reuse after it): stepped on the device
    assert ends == {0: (("x", 4),), 1: (("y", 4),), 2: (("b", 4), ("x", 4))}
    assert plan.host_updates == 4 and plan.host_bytes == 16 and plan.written_bytes == 0
    # without weights every op travels with its state and nothing is stepped on the host
    device = plan_stage(sched, 0, sizes, 100, "belady", prefetch_depth=0)
    assert device.host_updates == 0 and device.fetched_bytes == 40 > plan.fetched_bytes
    assert all(not ev.host_updates for ev in device.events)


def test_hybrid_fetches_an_op_the_host_stepped_only_after_that_step() -> None:
    work, sizes, weights, sched = _hybrid_case()
    plans = [plan_stage(sched, s, sizes, 100, "belady", prefetch_depth=0, weights=weights) for s in range(P)]
    copies = residency_copies(sched, plans)
    idx: dict[str, int] = {}
    for i, c in enumerate(copies):  # each label's first job on stage 0 (subnet 0's)
        if c.stage == 0:
            idx.setdefault(c.label, i)
    (refetch,) = [c for c in copies if c.stage == 0 and c.label == "x" and c.before == Action(0, "F", 0, 2)]
    assert idx["host update x"] in refetch.waits_for
    assert copies[idx["host update x"]].waits_for == (idx["grads x"],)
    assert copies[idx["grads x"]].channel == "d2h" and copies[idx["grads x"]].nbytes == 4
    # a host that steps slowly delays the subnet that needs "x" again; a fast one costs nothing
    fast = HostLinks((math.inf,) * P, (math.inf,) * P, (math.inf,) * P)
    slow = HostLinks((math.inf,) * P, (math.inf,) * P, (0.1,) * P)  # 40 s a step of "x"
    base = simulate(sched, work=work)
    assert simulate(sched, work=work, copies=copies, links=fast).step_time == base.step_time
    r = simulate(sched, work=work, copies=copies, links=slow)
    assert r.step_time > base.step_time and Action(0, "F", 0, 2) in r.waited


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_never_exceeds_the_arena_and_moves_less_than_the_device_placement(seed: int) -> None:
    work, sizes = _stream(24, seed)
    weights = {op: n // 3 for op, n in sizes.items()}
    capacity = 2 * max(sum(sizes[o] for o in w.uses[s]) for w in work for s in range(P))
    sched = _schedule(work, sizes, capacity=capacity)
    for s in range(P):
        hybrid = plan_stage(sched, s, sizes, capacity, "belady", weights=weights)
        device = plan_stage(sched, s, sizes, capacity, "belady")
        assert hybrid.peak_bytes <= capacity and hybrid.uses == device.uses
        assert hybrid.hits + hybrid.prefetched + hybrid.misses == hybrid.uses
        assert hybrid.fetched_bytes + hybrid.written_bytes + hybrid.host_bytes \
            < device.fetched_bytes + device.written_bytes
        assert 0 < hybrid.host_updates < hybrid.uses


def test_hybrid_weights_must_fit_in_the_sizes() -> None:
    work, sizes, weights, sched = _hybrid_case()
    with pytest.raises(StageResidencyError, match="weight bytes"):
        plan_stage(sched, 0, sizes, 100, weights={**weights, "a": 11})
    with pytest.raises(StageResidencyError, match="weight bytes"):
        plan_stage(sched, 0, sizes, 100, weights={k: v for k, v in weights.items() if k != "x"})


def test_a_host_budget_keeps_the_state_of_the_ops_past_it() -> None:
    work, sizes, weights, sched = _hybrid_case()
    # subnet 0's host may step nothing: its "x" keeps its state (fetched whole, written back when
    # evicted changed); subnets 1 and 2 room for one op each (4 bytes): "b" goes first at 2, "x" keeps
    plan = plan_stage(sched, 0, sizes, 100, "belady", prefetch_depth=0, weights=weights,
                      host_budget={0: 0, 1: 4, 2: 4})
    fetched = sorted((f.op, f.subnet, f.nbytes) for ev in plan.events for f in ev.fetches)
    assert fetched == [("a", 0, 10), ("b", 2, 4), ("x", 0, 10), ("y", 1, 4)]  # "x" stays resident: no refetch
    ends = {ev.subnet: ev.host_updates for ev in plan.events if ev.kind == "end"}
    assert ends == {0: (), 1: (("y", 4),), 2: (("b", 4),)}
