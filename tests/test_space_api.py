"""Unit tests of the framework-free search-space API: Choice, Arch, SearchSpace."""
from __future__ import annotations

import random

import pytest

from supernet import Arch, Choice, SearchSpace, SearchSpaceError, SupernetError


@pytest.fixture
def space() -> SearchSpace:
    return SearchSpace([
        Choice("op", ("conv", "pool", "skip")),
        Choice("width", (16, 32, 64, 128)),
        Choice("fixed", (1,)),
        Choice("act", ("relu", "gelu")),
    ])


# -- Choice and SearchSpace construction ---------------------------------------------------
@pytest.mark.parametrize(
    "label, values, fragment",
    [
        ("", ("a",), "non-empty string"),
        ("x", (), "at least one value"),
        ("x", ("a", "a"), "distinct"),
        ("x", ((1, 2),), "JSON scalars"),
    ],
)
def test_bad_choice_raises(label: str, values: tuple, fragment: str) -> None:
    with pytest.raises(SearchSpaceError, match=fragment):
        Choice(label, values)


def test_choice_values_become_a_tuple() -> None:
    assert Choice("x", ["a", "b"]).values == ("a", "b")


def test_duplicate_labels_raise() -> None:
    with pytest.raises(SearchSpaceError, match="'op' appears twice"):
        SearchSpace([Choice("op", ("a",)), Choice("w", (1,)), Choice("op", ("b",))])


def test_size_and_labels(space: SearchSpace) -> None:
    assert space.size() == 3 * 4 * 1 * 2
    assert space.labels == ("op", "width", "fixed", "act")
    assert len(space) == 4
    assert SearchSpace([Choice(f"l{i}", tuple(range(24))) for i in range(48)]).size() == 24**48


def test_errors_are_value_errors() -> None:
    assert issubclass(SearchSpaceError, SupernetError)
    assert issubclass(SearchSpaceError, ValueError)


# -- validation ----------------------------------------------------------------------------
def test_validate_accepts_a_full_arch(space: SearchSpace) -> None:
    arch = space.validate({"op": "pool", "width": 32, "fixed": 1, "act": "relu"})
    assert isinstance(arch, Arch)
    assert arch["width"] == 32


def test_validate_bad_value_names_label_and_lists_values(space: SearchSpace) -> None:
    with pytest.raises(SearchSpaceError) as e:
        space.validate({"op": "pool", "width": 48, "fixed": 1, "act": "relu"}, where="search.seed_archs[2]")
    msg = str(e.value)
    assert "search.seed_archs[2].width" in msg
    assert "[16, 32, 64, 128]" in msg
    assert "48" in msg


def test_validate_missing_label(space: SearchSpace) -> None:
    with pytest.raises(SearchSpaceError, match=r"arch\.act: missing; expected one of \['relu', 'gelu'\]"):
        space.validate({"op": "pool", "width": 32, "fixed": 1})


def test_validate_unknown_label(space: SearchSpace) -> None:
    with pytest.raises(SearchSpaceError) as e:
        space.validate({"op": "pool", "width": 32, "fixed": 1, "act": "relu", "depth": 3})
    assert "arch.depth: unknown label" in str(e.value)
    assert "'op'" in str(e.value) and "'act'" in str(e.value)


def test_validate_rejects_non_mapping(space: SearchSpace) -> None:
    with pytest.raises(SearchSpaceError, match="expected a mapping"):
        space.validate(["pool", 32, 1, "relu"])  # type: ignore[arg-type]


def test_unknown_label_lookup(space: SearchSpace) -> None:
    assert space.choice("op").values == ("conv", "pool", "skip")
    with pytest.raises(SearchSpaceError, match="unknown label 'depth'"):
        space.choice("depth")


# -- random operations ---------------------------------------------------------------------
def test_random_is_deterministic_given_the_seed(space: SearchSpace) -> None:
    a = [space.random(random.Random(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    r1, r2 = random.Random(11), random.Random(11)
    assert [space.random(r1) for _ in range(20)] == [space.random(r2) for _ in range(20)]
    # Different seeds explore different archs (48 draws over 24 archs cannot all coincide).
    assert len({space.random(random.Random(s)) for s in range(48)}) > 1
    for s in range(20):
        space.validate(space.random(random.Random(s)))


def test_random_does_not_touch_global_rng(space: SearchSpace) -> None:
    random.seed(123)
    before = random.random()
    random.seed(123)
    space.random(random.Random(0))
    assert random.random() == before


@pytest.mark.parametrize("prob", [0.0, 0.1, 1.0])
def test_mutate_changes_something_and_stays_valid(space: SearchSpace, prob: float) -> None:
    rng = random.Random(3)
    for _ in range(50):
        parent = space.random(rng)
        child = space.mutate(parent, rng, prob=prob)
        space.validate(child)
        assert child != parent
        assert child["fixed"] == 1


def test_mutate_prob_one_changes_every_mutable_label(space: SearchSpace) -> None:
    parent = space.random(random.Random(0))
    child = space.mutate(parent, random.Random(1), prob=1.0)
    assert all(child[l] != parent[l] for l in ("op", "width", "act"))


def test_mutate_is_deterministic(space: SearchSpace) -> None:
    parent = space.random(random.Random(0))
    assert space.mutate(parent, random.Random(5), 0.3) == space.mutate(parent, random.Random(5), 0.3)


def test_mutate_rejects_bad_prob_and_bad_arch(space: SearchSpace) -> None:
    parent = space.random(random.Random(0))
    with pytest.raises(SearchSpaceError, match="mutate prob"):
        space.mutate(parent, random.Random(0), prob=1.5)
    with pytest.raises(SearchSpaceError, match="width"):
        space.mutate(parent.replace(width=7), random.Random(0))


def test_crossover_takes_each_label_from_a_parent(space: SearchSpace) -> None:
    rng = random.Random(9)
    mixed = False
    for _ in range(30):
        a, b = space.random(rng), space.random(rng)
        child = space.crossover(a, b, rng)
        space.validate(child)
        assert all(child[l] in (a[l], b[l]) for l in space.labels)
        mixed |= child != a and child != b
    assert mixed, "uniform crossover never mixed two parents in 30 tries"


def test_crossover_names_the_bad_parent(space: SearchSpace) -> None:
    a = space.random(random.Random(0))
    with pytest.raises(SearchSpaceError, match=r"crossover\.b\.op"):
        space.crossover(a, a.replace(op="dense"), random.Random(0))


# -- Arch ----------------------------------------------------------------------------------
def test_arch_equality_and_hash_ignore_insertion_order() -> None:
    a = Arch({"x": 1, "y": "conv"})
    b = Arch([("y", "conv"), ("x", 1)])
    assert a == b and hash(a) == hash(b)
    assert a == {"x": 1, "y": "conv"}
    assert a != Arch({"x": 2, "y": "conv"})
    assert len({a, b, Arch({"x": 2, "y": "conv"})}) == 2
    assert list(a) == ["x", "y"]
    assert repr(a) == "Arch(x=1, y='conv')"


def test_arch_is_read_only_and_replace_copies() -> None:
    a = Arch({"x": 1})
    with pytest.raises(TypeError):
        a["x"] = 2  # type: ignore[index]
    b = a.replace(x=2)
    assert a["x"] == 1 and b["x"] == 2
    with pytest.raises(KeyError):
        a["z"]


def test_json_round_trip(space: SearchSpace) -> None:
    rng = random.Random(4)
    for _ in range(10):
        arch = space.random(rng)
        text = space.encode(arch)
        assert space.decode(text) == arch
        assert Arch.from_json(arch.to_json()) == arch
        assert isinstance(space.decode(text)["width"], int)
    assert Arch({"b": 1, "a": "x"}).to_json() == '{"a":"x","b":1}'


def test_digest_is_stable() -> None:
    # A fixed value: the digest must not depend on the process (hash seed) or dict order.
    assert Arch({"b": 1, "a": "x"}).digest() == Arch({"a": "x", "b": 1}).digest()
    assert Arch({"a": "x", "b": 1}).digest() == "cdab067e9f3beb32"  # sha256 of its JSON, pinned
    assert len(Arch({"a": 1}).digest()) == 16
    assert Arch({"a": 1}).digest() != Arch({"a": 2}).digest()


@pytest.mark.parametrize("text, fragment", [("{not json", "could not parse"), ("[1, 2]", "expected an object")])
def test_bad_json_raises(text: str, fragment: str) -> None:
    with pytest.raises(SearchSpaceError, match=fragment):
        Arch.from_json(text)


def test_decode_validates(space: SearchSpace) -> None:
    with pytest.raises(SearchSpaceError, match=r"loaded\.op"):
        space.decode('{"act":"relu","fixed":1,"op":"dense","width":16}', where="loaded")
