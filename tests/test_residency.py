"""Residency plans: Belady against exhaustive search, the eviction rule, the budget, the baselines."""
from __future__ import annotations

import itertools
import random
from functools import lru_cache

import pytest

from pipeline.plan.residency import NEVER, ResidencyError, next_use, plan_residency


def optimal_fetches(trace: list[tuple[str, ...]], cache: int) -> int:
    """The fewest fetches any policy makes on a unit-size trace: exhaustive over eviction choices.

    Fetching only on demand loses nothing (a fetch made earlier can be made later at no extra
    cost), so the search branches over which resident ops each miss evicts."""
    @lru_cache(maxsize=None)
    def best(t: int, resident: frozenset) -> int:
        if t == len(trace):
            return 0
        need = set(trace[t])
        missing = need - resident
        room = cache - len(resident)
        n_evict = max(0, len(missing) - room)
        out = None
        for gone in itertools.combinations(sorted(resident - need), n_evict):
            r = (resident - set(gone)) | need
            v = len(missing) + best(t + 1, frozenset(r))
            out = v if out is None else min(out, v)
        return out

    return best(0, frozenset())


def random_trace(rng: random.Random, n_ops: int, length: int, per_step: int) -> list[tuple[str, ...]]:
    ops = [f"o{k}" for k in range(n_ops)]
    return [tuple(rng.sample(ops, rng.randint(1, per_step))) for _ in range(length)]


@pytest.mark.parametrize("seed", range(60))
def test_belady_matches_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n_ops, cache = rng.randint(3, 8), rng.randint(2, 4)
    per_step = 1 if seed % 2 == 0 else min(2, cache)  # classic paging, and steps needing two ops
    trace = random_trace(rng, n_ops, rng.randint(4, 12), per_step)
    sizes = {f"o{k}": 1 for k in range(n_ops)}
    plan = plan_residency(trace, sizes, cache, "belady", prefetch_depth=0)
    assert plan.misses == optimal_fetches(trace, cache)
    assert plan.prefetched == 0 and plan.fetches == plan.misses
    for policy in ("lru", "on_demand"):
        assert plan_residency(trace, sizes, cache, policy, prefetch_depth=0).misses >= plan.misses


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("policy", ["belady", "lru", "on_demand"])
def test_budget_eviction_rule_and_accounting(seed: int, policy: str) -> None:
    rng = random.Random(1000 + seed)
    n_ops = rng.randint(4, 12)
    sizes = {f"o{k}": rng.randint(1, 5) for k in range(n_ops)}
    trace = random_trace(rng, n_ops, rng.randint(5, 20), 3)
    budget = max(sum(sizes[o] for o in set(s)) for s in trace) + rng.randint(0, 8)
    depth = rng.randint(1, 3)
    plan = plan_residency(trace, sizes, budget, policy, prefetch_depth=depth, max_copies=rng.choice([None, 2]))
    future = next_use(trace)
    resident: set[str] = set()
    ahead: set[str] = set()
    for t, (need, st) in enumerate(zip(trace, plan.steps)):
        need = tuple(dict.fromkeys(need))
        assert st.peak_bytes <= budget and plan.peak_bytes <= budget
        # every op the step needs is accounted for exactly once
        assert sorted(st.hits + st.prefetched + st.misses) == sorted(need)
        assert set(st.hits) | set(st.prefetched) <= resident and not set(st.misses) & resident
        assert set(st.prefetched) <= ahead
        for op in st.demand_evict:
            assert op not in need
        resident -= set(st.demand_evict)
        resident |= set(need)
        ahead -= set(need)
        assert sum(sizes[o] for o in resident) <= budget
        if policy == "on_demand":
            assert st.prefetch == ()
        later = st.evict[len(st.demand_evict):]
        for op in st.prefetch:
            u = future.after(op, t + 1)
            assert t < u <= t + depth
        if policy == "belady":
            # prefetching never evicts an op needed no later than the op being fetched
            first_fetch_use = min((future.after(o, t + 1) for o in st.prefetch), default=NEVER)
            for op in later:
                assert op not in need
                assert future.after(op, t + 1) > first_fetch_use
        resident -= set(later)
        resident |= set(st.prefetch)
        ahead = (ahead - set(later)) | set(st.prefetch)
        assert sum(sizes[o] for o in resident) == st.resident_bytes <= budget
        # every eviction made room for one fetch of this step
        assert sorted(v for _, vs in st.evicted_for for v in vs) == sorted(st.evict)
        assert {op for op, _ in st.evicted_for} <= set(st.fetches)
    assert plan.uses == sum(len(set(s)) for s in trace)
    assert plan.fetched_bytes == sum(sizes[o] for st in plan.steps for o in st.fetches)


def test_belady_prefetch_hides_what_fits_and_beats_lru() -> None:
    # a cyclic trace one op larger than the cache: LRU misses every time, Belady keeps most
    trace = [(f"o{k % 5}",) for k in range(40)]
    sizes = {f"o{k}": 1 for k in range(5)}
    bel = plan_residency(trace, sizes, 4, "belady", prefetch_depth=0)
    lru = plan_residency(trace, sizes, 4, "lru", prefetch_depth=0)
    assert lru.hits == 0 and bel.hits > 25
    # with prefetch no step waits once the first op is there; the price is a few more fetches
    # (the op in use is pinned while the next one is fetched), and looking two steps ahead
    # costs no more than one
    pre = plan_residency(trace, sizes, 4, "belady", prefetch_depth=1)
    assert pre.misses == 1 and (pre.hits, pre.fetches) == (24, 16)
    assert plan_residency(trace, sizes, 4, "belady", prefetch_depth=2).fetches == pre.fetches
    lru_pre = plan_residency(trace, sizes, 4, "lru", prefetch_depth=1)
    assert lru_pre.misses == 1 and lru_pre.hits == 0 and lru_pre.fetches == 40


def test_no_reuse_fetches_every_use_ahead() -> None:
    trace = [("a", "b"), ("a", "c"), ("a", "b")]
    sizes = {"a": 2, "b": 1, "c": 1}
    plan = plan_residency(trace, sizes, 6, "belady", prefetch_depth=1, reuse=False)
    # 'a' runs in every step: its new weights exist only after the host updated them, when the
    # step that used it has ended, so each of its uses is fetched on demand; b and c come ahead
    assert plan.hits == 0 and plan.misses == 4 and plan.prefetched == 2
    assert [st.misses for st in plan.steps] == [("a", "b"), ("a",), ("a",)]
    assert all(st.dropped == tuple(dict.fromkeys(trace[t])) for t, st in enumerate(plan.steps))
    assert plan.writeback_bytes == 0
    # the next step's ops fit beside this step's only with room for both
    tight = plan_residency(trace, sizes, 3, "belady", prefetch_depth=1, reuse=False)
    assert tight.prefetched == 0 and tight.misses == 6


def test_writeback_only_when_dirty() -> None:
    trace = [("a",), ("b",), ("a",)]
    sizes = {"a": 1, "b": 1}
    plan = plan_residency(trace, sizes, 1, "belady", prefetch_depth=0)
    assert plan.steps[1].writeback == ("a",) and plan.steps[2].writeback == ("b",)
    clean = plan_residency(trace, sizes, 1, "belady", prefetch_depth=0, dirty_on_use=False)
    assert clean.writeback_bytes == 0 and clean.fetches == 3


def test_infeasible_budget_names_the_shortfall() -> None:
    sizes = {"a": 3 << 20, "b": 2 << 20, "c": 1 << 20}
    with pytest.raises(ResidencyError, match=r"step 1 .* short by 1048576 bytes \(1.00 MiB\)") as e:
        plan_residency([("a",), ("a", "b", "c")], sizes, 5 << 20)
    assert e.value.short_by == 1 << 20 and e.value.step == 1
    with pytest.raises(ResidencyError, match="policy: expected one of"):
        plan_residency([("a",)], sizes, 10 << 20, "fifo")
    with pytest.raises(ResidencyError, match=r"uses\[0\]: op 'z' has no entry"):
        plan_residency([("z",)], sizes, 10 << 20)


def test_next_use() -> None:
    nu = next_use([("a", "b"), ("c",), ("a",)])
    assert nu.after("a", 0) == 0 and nu.after("a", 1) == 2 and nu.after("b", 1) == NEVER
    assert nu.after("zzz", 0) == NEVER
