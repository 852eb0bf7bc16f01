"""Unit tests of the supernet graph (order, errors, slots) and the op registry (build_op)."""
from __future__ import annotations

import random

import pytest
import torch

from supernet import (
    INPUT, Arch, OpError, OpSpec, SearchSpaceError, SupernetError, SupernetGraph, build_op,
    register_op, registered_ops,
)

LIN = OpSpec.of("linear", d_in=4, d_out=4)


def dag() -> SupernetGraph:
    """A non-chain graph: skip edges, a three-input node, a choice slot fed by two producers,
    and nodes added in an order that is not the only topological one."""
    g = SupernetGraph("dag")
    g.add_fixed("a", LIN, [INPUT])
    g.add_choice("b", {"lin": LIN, "mlp": OpSpec.of("mlp", d=4, hidden=8), "id": OpSpec.of("identity")}, ["a"])
    g.add_fixed("side", LIN, [INPUT])  # independent of a and b: could come first
    g.add_fixed("c", OpSpec.of("sum"), ["b", "a", "side"])  # skip edges a -> c, input -> side -> c
    g.add_choice("d", {"zero": OpSpec.of("zero"), "lin": LIN}, ["c"])
    g.add_fixed("e", OpSpec.of("sum"), ["d", "c", "d"])  # the same producer twice
    return g


def chain(n: int) -> SupernetGraph:
    g = SupernetGraph("chain")
    prev = INPUT
    for i in range(n):
        prev = g.add_choice(f"s{i}", {"lin": LIN, "id": OpSpec.of("identity")}, [prev])
    return g


# -- order ---------------------------------------------------------------------------------
def test_order_is_topological_with_insertion_tie_break() -> None:
    g = dag()
    assert g.nodes() == ("a", "b", "side", "c", "d", "e")
    pos = {n: i for i, n in enumerate((INPUT, *g.nodes()))}
    for n in g.nodes():
        assert all(pos[src] < pos[n] for src in g.inputs_of(n)), n


def test_order_is_the_same_for_every_build_and_arch() -> None:
    g1, g2 = dag(), dag()
    assert g1.nodes() == g2.nodes()
    assert g1.slots() == g2.slots()
    rng = random.Random(0)
    for _ in range(6):
        arch = g1.space().random(rng)
        ops = g1.active_ops(arch)
        assert ops == g2.active_ops(arch)
        assert [op.node for op in ops] == list(g1.nodes())


def test_active_ops_keep_argument_order_and_pick_the_candidate() -> None:
    g = dag()
    ops = {op.node: op for op in g.active_ops(Arch({"b": "mlp", "d": "zero"}))}
    assert ops["c"].inputs == ("b", "a", "side")
    assert ops["e"].inputs == ("d", "c", "d")
    assert ops["b"].op_id == "b/mlp" and ops["b"].spec.kind == "mlp"
    assert ops["d"].op_id == "d/zero" and ops["d"].spec == OpSpec.of("zero")
    assert ops["a"].op_id == "a"
    assert g.consumers_of("a") == ("b", "c")
    assert g.consumers_of(INPUT) == ("a", "side")


def test_active_ops_validate_the_arch() -> None:
    g = dag()
    with pytest.raises(SearchSpaceError, match=r"arch\.b: expected one of \['lin', 'mlp', 'id'\], found 'conv'"):
        g.active_ops(Arch({"b": "conv", "d": "zero"}))
    with pytest.raises(SearchSpaceError, match=r"arch\.d: missing"):
        g.active_ops(Arch({"b": "lin"}))


# -- slots and space -----------------------------------------------------------------------
def test_slots_name_candidates_slot_slash_candidate() -> None:
    g = dag()
    ids = [s.op_id for s in g.slots()]
    assert ids == ["a", "b/lin", "b/mlp", "b/id", "side", "c", "d/zero", "d/lin", "e"]
    assert {s.node for s in g.slots() if s.op_id.startswith("b/")} == {"b"}
    assert g.is_choice("b") and not g.is_choice("c")


def test_space_has_one_choice_per_slot() -> None:
    space = dag().space()
    assert space.labels == ("b", "d")
    assert space.choice("b").values == ("lin", "mlp", "id")
    assert space.size() == 6
    assert chain(5).space().size() == 2**5


# -- construction errors -------------------------------------------------------------------
def test_duplicate_node_raises() -> None:
    g = dag()
    with pytest.raises(SupernetError, match="node 'c' already exists"):
        g.add_fixed("c", LIN, ["a"])
    with pytest.raises(SupernetError, match="'input' already exists"):
        g.add_fixed(INPUT, LIN, ["a"])


def test_unknown_input_raises() -> None:
    g = SupernetGraph()
    with pytest.raises(SupernetError, match="input 'later' does not exist yet"):
        g.add_fixed("x", OpSpec.of("sum"), [INPUT, "later"])
    with pytest.raises(SupernetError, match="expected at least one input"):
        g.add_fixed("x", LIN, [])


@pytest.mark.parametrize("name", ["1a", "a/b", "", "a-b"])
def test_bad_node_name_raises(name: str) -> None:
    with pytest.raises(SupernetError, match="expected an identifier"):
        SupernetGraph().add_fixed(name, LIN, [INPUT])


def test_bad_candidates_raise() -> None:
    with pytest.raises(SupernetError, match="candidate name 'a/b'"):
        SupernetGraph().add_choice("s", {"a/b": LIN}, [INPUT])
    with pytest.raises(SupernetError, match="at least one candidate"):
        SupernetGraph().add_choice("s", {}, [INPUT])


def test_exactly_one_output() -> None:
    assert dag().output == "e"
    g = SupernetGraph("two_sinks")
    g.add_fixed("a", LIN, [INPUT])
    g.add_fixed("b", LIN, ["a"])
    g.add_fixed("c", LIN, ["a"])
    with pytest.raises(SupernetError, match=r"exactly one output node.*\['b', 'c'\]"):
        g.output
    with pytest.raises(SupernetError, match="exactly one output"):
        SupernetGraph("empty").output


# -- the op registry -----------------------------------------------------------------------
def test_unknown_op_kind_names_kind_and_lists_registered_ops() -> None:
    with pytest.raises(OpError) as e:
        build_op(OpSpec.of("no_such_op", d=3), "s0/x", seed=0)
    msg = str(e.value)
    assert "'no_such_op'" in msg and "'s0/x'" in msg
    for name in ("identity", "linear", "mlp", "sum", "zero"):
        assert name in msg
    assert "register_op" in msg
    assert isinstance(e.value, SupernetError) and isinstance(e.value, ValueError)


def test_bad_op_arguments_raise_op_error() -> None:
    with pytest.raises(OpError, match="bad arguments"):
        build_op(OpSpec.of("linear", d_in=4), "x", seed=0)


def test_registering_a_name_twice_raises() -> None:
    @register_op("test_graph_twice")
    class A(torch.nn.Identity):
        pass

    assert "test_graph_twice" in registered_ops()
    register_op("test_graph_twice")(A)  # the same builder again is harmless
    with pytest.raises(OpError, match="already registered"):
        register_op("test_graph_twice")(torch.nn.Identity)


def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_build_op_init_does_not_depend_on_build_order() -> None:
    spec_a, spec_b = OpSpec.of("mlp", d=6, hidden=12), OpSpec.of("linear", d_in=6, d_out=6)
    a_first = build_op(spec_a, "slot/a", seed=3)
    build_op(spec_b, "slot/b", seed=3)
    build_op(spec_b, "slot/b", seed=3)
    a_second = build_op(spec_a, "slot/a", seed=3)
    torch.manual_seed(999)  # global RNG state must not matter either
    a_third = build_op(spec_a, "slot/a", seed=3)
    for m in (a_second, a_third):
        for (k, v), w in zip(_weights(a_first).items(), _weights(m).values()):
            assert torch.equal(v, w), k


def test_build_op_init_depends_on_seed_and_op_id() -> None:
    spec = OpSpec.of("linear", d_in=6, d_out=6)
    base = build_op(spec, "x", seed=0).fc.weight
    assert not torch.equal(base, build_op(spec, "y", seed=0).fc.weight)
    assert not torch.equal(base, build_op(spec, "x", seed=1).fc.weight)


def test_build_op_leaves_global_rng_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_op(OpSpec.of("mlp", d=4, hidden=4), "z", seed=0)
    assert torch.equal(torch.rand(3), expected)
