"""Samplers: deterministic streams, lookahead that does not consume, FairNAS fairness, resume."""
from __future__ import annotations

from collections import Counter

import pytest

from search.samplers import ORDERS, FairSampler, SamplerError, UniformSampler, make_sampler
from supernet import Arch, Choice, SearchSpace, SupernetError

SPACE = SearchSpace([
    Choice("a", ("x", "y", "z", "w")),  # the widest label: rounds of 4
    Choice("b", (1, 2)),
    Choice("c", ("p", "q", "r")),
    Choice("d", (True,)),
])
KINDS = ["uniform", "fair"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_stream_other_seed_other_stream(kind: str, order: str) -> None:
    s1, s2, s3 = (make_sampler(kind, SPACE, seed, order=order) for seed in (7, 7, 8))
    one = [s1.next() for _ in range(40)]
    assert one == [s2.next() for _ in range(40)]
    assert one != [s3.next() for _ in range(40)]
    assert one[0] == make_sampler(kind, SPACE, 7, order=order).peek(1)[0]
    assert all(SPACE.validate(arch) == arch for arch in one)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_peek_does_not_consume_and_equals_next(kind: str, order: str) -> None:
    s = make_sampler(kind, SPACE, 3, order=order)
    plain = make_sampler(kind, SPACE, 3, order=order)
    expected = [plain.next() for _ in range(30)]
    got = []
    for k in (0, 5, 1, 9, 2, 0, 13):
        ahead = s.peek(k)
        assert s.peek(k) == ahead  # peeking twice changes nothing
        assert s.consumed == len(got)
        assert ahead == expected[len(got) : len(got) + k]
        got += [s.next() for _ in range(min(k, 3))]  # consume fewer than peeked, sometimes none
    got += [s.next() for _ in range(30 - len(got))]
    assert got == expected
    with pytest.raises(SamplerError, match="k >= 0"):
        s.peek(-1)


def test_fair_rounds_use_every_candidate_equally() -> None:
    s = FairSampler(SPACE, 11)
    n = s.round_size
    assert n == 4
    counts = {c.label: Counter() for c in SPACE.choices}
    for r in range(1, 13):
        for arch in (s.next() for _ in range(n)):
            for label, value in arch.items():
                counts[label][value] += 1
        # the widest label: every candidate exactly once per round
        assert counts["a"] == Counter({v: r for v in ("x", "y", "z", "w")})
        # labels with fewer values: counts never differ by more than one ...
        for c in SPACE.choices:
            assert max(counts[c.label].values()) - min(counts[c.label][v] for v in c.values) <= 1
            # ... and are equal whenever the rounds cover whole passes over the values
            if (r * n) % len(c.values) == 0:
                assert set(counts[c.label][v] for v in c.values) == {r * n // len(c.values)}


def test_uniform_covers_every_value() -> None:
    s = UniformSampler(SPACE, 0)
    counts = Counter(s.next()["c"] for _ in range(600))
    assert set(counts) == {"p", "q", "r"} and min(counts.values()) > 150


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_resume_equals_uninterrupted(kind: str, order: str) -> None:
    full = make_sampler(kind, SPACE, 5, order=order)
    expected = [full.next() for _ in range(25)]
    first = make_sampler(kind, SPACE, 5, order=order)
    head = [first.next() for _ in range(9)]
    first.peek(6)  # lookahead is not part of the state
    state = first.state_dict()
    assert state["consumed"] == 9
    resumed = make_sampler(kind, SPACE, 5, order=order)
    resumed.next()  # whatever it did before, loading puts it at the saved position
    resumed.load_state_dict(state)
    assert head + [resumed.next() for _ in range(16)] == expected


def test_state_from_another_sampler_is_refused() -> None:
    state = make_sampler("fair", SPACE, 5).state_dict()
    with pytest.raises(SamplerError, match="saved kind is 'fair'"):
        make_sampler("uniform", SPACE, 5).load_state_dict(state)
    with pytest.raises(SamplerError, match="saved seed is 5"):
        make_sampler("fair", SPACE, 6).load_state_dict(state)
    other = SearchSpace([Choice("a", ("x", "y"))])
    with pytest.raises(SamplerError, match="saved space"):
        make_sampler("fair", other, 5).load_state_dict(state)


def test_unknown_sampler_names_the_field() -> None:
    with pytest.raises(SamplerError, match=r"sampler.name: expected one of \['fair', 'fixed', 'uniform'\], found 'greedy'"):
        make_sampler("greedy", SPACE, 0)


def test_fixed_sampler_repeats_its_arch_and_needs_one() -> None:
    from search.samplers import FixedSampler

    space = SearchSpace([Choice("a", (1, 2)), Choice("b", ("x", "y", "z"))])
    s = make_sampler("fixed", space, 0, {"a": 2, "b": "y"})
    assert isinstance(s, FixedSampler) and s.peek(2) == [s.next(), s.next()] == [Arch({"a": 2, "b": "y"})] * 2
    with pytest.raises(SamplerError, match="sampler.arch: the fixed sampler needs the arch"):
        make_sampler("fixed", space, 0)
    with pytest.raises(SupernetError, match="sampler.arch.b: expected one of"):
        make_sampler("fixed", space, 0, {"a": 2, "b": "w"})
    with pytest.raises(SamplerError, match="only the fixed sampler takes an arch"):
        make_sampler("uniform", space, 0, {"a": 2, "b": "y"})
