"""Evolutionary and random search on synthetic scorers; subnet costs and constraints."""
from __future__ import annotations

import random

import pytest

from search.evolution import BatchScorer, Constraints, SearchError, SubnetCost, evolution_search, random_search
from supernet import Arch, Choice, SearchSpace
from supernet.spaces import conv

VALUES = tuple(range(6))
SPACE = SearchSpace([Choice(f"x{i}", VALUES) for i in range(8)])  # 6**8 ~ 1.7M archs
TARGET = {f"x{i}": (3 * i + 1) % 6 for i in range(8)}


def synthetic_score(arch: Arch) -> float:
    """Deterministic, with structure to exploit: closeness to a hidden target per label."""
    return float(sum(1.0 - abs(arch[k] - v) / 5 for k, v in TARGET.items()))


class Counting:
    def __init__(self) -> None:
        self.calls: list[Arch] = []

    def __call__(self, arch: Arch) -> float:
        self.calls.append(arch)
        return synthetic_score(arch)


def evolve(seed: int, scorer=synthetic_score, **kw):
    args = dict(population=12, generations=8, mutate_prob=0.15, crossover_prob=0.5, top_k=4)
    args.update(kw)
    return evolution_search(SPACE, scorer, random.Random(seed), **args)


def test_same_seed_same_result() -> None:
    a, b, c = evolve(1), evolve(1), evolve(2)
    assert a == b
    assert a.top != c.top or a.history != c.history
    assert len(a.top) == 4 and a.evaluated == 12 * 8
    assert [x.score for x in a.top] == sorted((x.score for x in a.top), reverse=True)
    assert list(a.history) == sorted(a.history)  # best-so-far never gets worse


def test_scores_are_memoised_and_budget_counts_distinct_archs() -> None:
    scorer = Counting()
    res = evolve(0, scorer)
    assert len(scorer.calls) == len(set(scorer.calls)) == res.evaluated == 96
    scorer = Counting()
    res = random_search(SPACE, scorer, random.Random(0), budget=50, top_k=3)
    assert len(scorer.calls) == len(set(scorer.calls)) == res.evaluated == 50


def test_evolution_beats_or_equals_random_at_the_same_budget() -> None:
    wins = 0
    for seed in range(5):
        evo = evolve(seed)
        rnd = random_search(SPACE, synthetic_score, random.Random(seed), budget=evo.evaluated, top_k=4)
        assert evo.evaluated == rnd.evaluated
        assert evo.best.score >= rnd.best.score
        wins += evo.best.score > rnd.best.score
    assert wins >= 4


def test_a_batch_scorer_gets_whole_generations_and_changes_nothing() -> None:
    """Each generation (random search: the whole budget) is proposed before any of it is scored,
    so a batch scorer (the app's parallel scoring) sees it at once, and the search is the same."""
    small = lambda a: sum(a.values()) <= 20  # noqa: E731
    for kw in ({}, {"constraint": small}, {"seed_archs": [TARGET]}):
        batches: list[list[Arch]] = []

        def batched(archs):
            batches.append(list(archs))
            return [synthetic_score(a) for a in archs]

        one_by_one = Counting()
        assert evolve(5, BatchScorer(batched), **kw) == evolve(5, one_by_one, **kw)
        assert [a for b in batches for a in b] == one_by_one.calls  # the same archs in the same order
        assert [len(b) for b in batches] == [12] * 8
        batches.clear()
        one_by_one = Counting()
        assert (random_search(SPACE, BatchScorer(batched), random.Random(5), budget=30, **kw)
                == random_search(SPACE, one_by_one, random.Random(5), budget=30, **kw))
        assert batches == [one_by_one.calls] and len(batches[0]) == 30
    with pytest.raises(SearchError, match="search: the batch scorer returned 1 scores for 12 archs"):
        evolve(0, BatchScorer(lambda archs: [0.0]))


def test_constraint_is_respected_and_failing_archs_are_never_scored() -> None:
    def small(arch: Arch) -> bool:
        return sum(arch.values()) <= 14

    scorer = Counting()
    res = evolve(3, scorer, constraint=small)
    assert scorer.calls and all(small(a) for a in scorer.calls)
    assert all(small(c.arch) for c in res.top)
    unconstrained = evolve(3)
    assert not small(unconstrained.best.arch)  # the constraint did bind
    scorer = Counting()
    res = random_search(SPACE, scorer, random.Random(3), budget=30, constraint=small)
    assert all(small(a) for a in scorer.calls) and res.evaluated == 30


def test_seed_archs_enter_first_and_are_validated() -> None:
    seed_arch = Arch(TARGET)
    res = evolve(0, seed_archs=[seed_arch])
    assert res.best.arch == seed_arch and res.history[0] == synthetic_score(seed_arch)
    bad = dict(TARGET, x9=0)
    with pytest.raises(ValueError, match=r"search.seed_archs\[0\].x9: unknown label"):
        evolve(0, seed_archs=[bad])
    with pytest.raises(ValueError, match=r"search.seed_archs\[1\].x2: expected one of \[0, 1, 2, 3, 4, 5\], found 9"):
        random_search(SPACE, synthetic_score, random.Random(0), budget=5, seed_archs=[TARGET, dict(TARGET, x2=9)])


def test_small_space_stops_when_exhausted() -> None:
    tiny = SearchSpace([Choice("a", (0, 1)), Choice("b", (0, 1))])
    res = evolution_search(tiny, lambda a: a["a"] + a["b"], random.Random(0), population=3, generations=10)
    assert res.evaluated == 4 and res.best.arch == Arch({"a": 1, "b": 1})


def test_bad_settings_and_impossible_constraints() -> None:
    with pytest.raises(SearchError, match="search.population: expected an integer >= 2, found 1"):
        evolve(0, population=1)
    with pytest.raises(SearchError, match=r"search.mutate_prob: expected a probability in \[0, 1\], found 1.5"):
        evolve(0, mutate_prob=1.5)
    with pytest.raises(SearchError, match="no architecture that satisfies search.constraints"):
        evolve(0, constraint=lambda a: False)


def test_subnet_cost_params_and_flops() -> None:
    graph = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])
    cost = SubnetCost(graph, (1, 8, 8))
    space = graph.space()
    big = Arch({c.label: "k5e6" for c in space.choices})
    small = Arch({c.label: "k3e3" for c in space.choices})
    # params: the numel of the active ops' weights, built for real here as the reference
    from supernet import Supernet

    net = Supernet(graph, 0)
    for arch in (big, small):
        expect = sum(p.numel() for op in graph.active_ops(arch) for p in net.ops[op.op_id].parameters())
        assert cost.params(arch) == expect
    assert cost.params(big) > cost.params(small)
    # flops: the 3x3 stem conv alone is 2 * 64 positions * 4 out * 9 taps, and a bigger
    # kernel and expansion cost more
    assert cost.flops(small) > 2 * 64 * 4 * 9
    assert cost.flops(big) > cost.flops(small)
    skip_first = small.replace(layer00="skip")
    assert cost.flops(skip_first) < cost.flops(small)

    limits = Constraints(max_params=cost.params(small), max_flops=None)
    ok = limits.check(cost)
    assert ok(small) and not ok(big)
    assert Constraints().check(cost) is None
    ok = Constraints(max_flops=cost.flops(small)).check(cost)
    assert ok(small) and not ok(big)
