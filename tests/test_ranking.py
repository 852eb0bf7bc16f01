"""bench/ranking.py: the rank statistics, the arch set and the stand-alone cache."""
from __future__ import annotations

import random
from pathlib import Path

import sys

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ranking  # noqa: E402


def test_tau_rho_and_regret_match_their_definitions() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.choice([0.1, 0.2, 0.3, 0.5]) + rng.random() * 0.01 * rng.randint(0, 1) for _ in range(12)]
        b = [x + rng.gauss(0, 0.1) if rng.random() < 0.8 else 0.3 for x in a]
        assert ranking.kendall_tau(a, b) == pytest.approx(stats.kendalltau(a, b).statistic)  # tau-b, with ties
        assert ranking.spearman_rho(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)
    assert ranking.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert ranking.top_k_regret([0.9, 0.8, 0.7], [0.5, 0.6, 0.9], 1) == pytest.approx(0.4)
    assert ranking.top_k_regret([0.9, 0.8, 0.7], [0.5, 0.6, 0.9], 3) == 0.0


def test_archs_are_distinct_non_degenerate_and_spread_over_params() -> None:
    from search.evolution import SubnetCost

    archs = ranking.stratified_archs(10, pool=300)
    assert len({tuple(sorted(a.items())) for a in archs}) == 10
    assert not any(ranking.degenerate(a) for a in archs)
    params = [SubnetCost(ranking._graph(), (1, 8, 8)).params(a) for a in archs]
    assert params == sorted(params) and params[-1] > 3 * params[0]
    cut = dict(archs[0], c0_e3_0="none", c0_e3_1="none", c0_e3_2="none")  # nothing reaches cell 0's output
    assert ranking.degenerate(cut)


def test_standalone_runs_the_app_once_then_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import search.app

    monkeypatch.setattr(ranking, "CACHE", tmp_path)
    monkeypatch.setattr(ranking, "STANDALONE", {**ranking.STANDALONE, "steps": 3, "warmup_steps": 1})
    arch = ranking.stratified_archs(1, pool=20)[0]
    first = ranking.standalone(arch, 0)
    assert first["arch"] == arch and 0 <= first["val_accuracy"] <= 1 and len(list(tmp_path.iterdir())) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("trained again despite the cache")

    monkeypatch.setattr(search.app, "run", no_training)
    assert ranking.standalone(arch, 0) == first
    monkeypatch.setattr(ranking, "STANDALONE", {**ranking.STANDALONE, "steps": 4})  # another recipe: another key
    with pytest.raises(AssertionError, match="trained again"):
        ranking.standalone(arch, 0)


def test_intervals_of_the_mean_over_seeds() -> None:
    """tau's 95 % interval over supernet seeds: Student's t (as scipy computes it) and a seeded
    percentile bootstrap that agrees with it on well-behaved data and is reproducible."""
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(1)
    xs = [0.45 + rng.gauss(0, 0.1) for _ in range(20)]
    lo, hi = ranking.t_interval(xs)
    want = stats.t.interval(0.95, len(xs) - 1, loc=sum(xs) / len(xs), scale=stats.sem(xs))
    assert (lo, hi) == pytest.approx(want, abs=1e-3)
    blo, bhi = ranking.bootstrap_interval(xs)
    assert ranking.bootstrap_interval(xs) == (blo, bhi)  # seeded
    assert lo < blo < sum(xs) / len(xs) < bhi < hi and (bhi - blo) == pytest.approx(hi - lo, rel=0.2)
    # a df missing from the table takes the next lower one: never narrower than scipy's
    ys = xs + xs[:3]  # 23 values: df 22, not in the table
    lo, hi = ranking.t_interval(ys)
    assert (hi - lo) / 2 >= stats.t.ppf(0.975, len(ys) - 1) * stats.sem(ys) > 0
    assert all(v != v for v in ranking.t_interval([0.5]))  # nan below two values
