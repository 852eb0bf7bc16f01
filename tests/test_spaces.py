"""Tests of the built-in spaces: structure, option checks, supernet == extracted subnet, and the
per-op executor (cut anywhere) against plain autograd."""
from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from supernet import (
    INPUT, Arch, OpContext, OpSpec, SearchSpaceError, SliceRun, Supernet, SupernetError, SupernetGraph,
    classification_loss, cut, loss_and_grad, registered_ops,
)
from supernet.spaces import SPACES, build_space, cell, conv, resmlp, transformer

SHAPE = (1, 8, 8)  # one sklearn-digits image
CLASSES = 10
SEED = 17

# Small settings for each space; the transformer ones cover every candidate family and
# dropout, so the train-mode checks also check derived randomness.
SMALL: dict[str, dict] = {
    "transformer": dict(
        layers=3, width=16, dropout=0.1,
        candidates=["attn2", "attn4", "ffn2", "conv3", "sepconv5", "lightconv3h4", "glu", "identity"],
    ),
    "conv": dict(),
    "cell": dict(),
    "resmlp": dict(),
}


def make(space: str, **over: object) -> tuple[SupernetGraph, Supernet]:
    graph = build_space(space, input_shape=SHAPE, num_classes=CLASSES, **{**SMALL[space], **over})
    return graph, Supernet(graph, seed=SEED)


def archs(graph: SupernetGraph, n: int = 3) -> list[Arch]:
    """``n`` random archs, plus for the cell space the all-none and all-skip extremes."""
    rng = random.Random(1234)
    out = [graph.space().random(rng) for _ in range(n)]
    if graph.name == "cell":
        out += [Arch({l: v for l in graph.space().labels}) for v in ("none", "skip")]
    return out


def data(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return torch.randn(batch, *SHAPE, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


# -- structure -----------------------------------------------------------------------------
def test_registry_maps_names_to_builders() -> None:
    assert SPACES == {"transformer": transformer.build, "conv": conv.build, "cell": cell.build,
                      "resmlp": resmlp.build}


def test_transformer_structure() -> None:
    g = transformer.build(input_shape=SHAPE, num_classes=CLASSES)
    space = g.space()
    assert space.labels == ("layer00", "layer01", "layer02", "layer03")
    assert all(c.values == transformer.DEFAULT_CANDIDATES for c in space.choices)
    assert g.nodes() == ("stem", *space.labels, "head") and g.output == "head"
    assert transformer.build(input_shape=SHAPE, num_classes=2, layers=101).space().labels[-1] == "layer100"


def test_conv_structure_skip_only_where_shapes_match() -> None:
    g = conv.build(input_shape=SHAPE, num_classes=CLASSES)
    space = g.space()
    assert space.labels == ("layer00", "layer01", "layer02", "layer03")
    blocks = ("k3e3", "k3e6", "k5e3", "k5e6")
    assert space.choice("layer00").values == (*blocks, "skip")
    assert space.choice("layer02").values == blocks  # stride 2, 8 -> 16 channels
    assert space.choice("layer03").values == (*blocks, "skip")
    specs = {s.op_id: s.spec.kwargs() for s in g.slots()}
    assert specs["layer02/k5e6"] == dict(c_in=8, c_out=16, kernel=5, expansion=6, stride=2)
    assert specs["layer03/k3e3"]["stride"] == 1
    g = conv.build(input_shape=SHAPE, num_classes=CLASSES, allow_skip=False, channels=12, downsample_at=[0, 3])
    assert all("skip" not in c.values for c in g.space().choices)
    assert {s.spec.kwargs().get("c_out") for s in g.slots() if "/" in s.op_id} == {12}


def test_cell_structure_is_a_dag_of_edge_slots_and_sums() -> None:
    g = cell.build(input_shape=SHAPE, num_classes=CLASSES, cells=2)
    space = g.space()
    edges = [f"c{c}_e{j}_{i}" for c in range(2) for j in range(1, 4) for i in range(j)]
    assert space.labels == tuple(edges)
    assert all(ch.values == cell.EDGE_CANDIDATES for ch in space.choices)
    assert space.size() == 5**12
    assert g.inputs_of("c0_n3") == ("c0_e3_0", "c0_e3_1", "c0_e3_2")
    assert g.inputs_of("c0_e3_0") == ("stem",) and g.inputs_of("c0_e3_2") == ("c0_n2",)
    assert g.inputs_of("c1_e1_0") == ("c0_n3",) and g.inputs_of("head") == ("c1_n3",)
    assert g.consumers_of("stem") == ("c0_e1_0", "c0_e2_0", "c0_e3_0")
    kinds = {s.op_id: s.spec.kind for s in g.slots()}
    assert kinds["c0_e1_0/none"] == "zero" and kinds["c0_e1_0/skip"] == "identity"
    assert kinds["c0_n2"] == "sum"


def test_resmlp_structure_has_a_mid_graph_transition_and_a_two_branch_slot() -> None:
    g = resmlp.build(input_shape=SHAPE, num_classes=CLASSES)
    space = g.space()
    assert space.labels == ("a0", "a1", "a2", "a3", "b0", "fork_l", "fork_r")
    assert all(space.choice(l).values == resmlp.BLOCK_CANDIDATES for l in ("a0", "a3", "b0"))
    assert space.choice("fork_l").values == space.choice("fork_r").values == resmlp.BRANCH_CANDIDATES
    assert space.size() == 3**7
    assert g.nodes() == ("stem", "a0", "a1", "a2", "a3", "transition", "b0", "fork_l", "fork_r", "merge", "head")
    assert g.inputs_of("transition") == ("a3",) and g.inputs_of("b0") == ("transition",)
    assert g.inputs_of("fork_l") == g.inputs_of("fork_r") == ("b0",)
    assert g.inputs_of("merge") == ("b0", "fork_l", "fork_r") and g.inputs_of("head") == ("merge",)
    specs = {s.op_id: s.spec for s in g.slots()}
    assert specs["transition"].kwargs() == dict(d_in=24, d_out=32)
    assert specs["a0/mlp"].kwargs() == dict(d=24, residual=True)
    assert specs["fork_l/gated"].kwargs() == dict(d=32, residual=False) and specs["fork_r/none"].kind == "zero"
    active = g.active_ops(space.random(random.Random(0)))
    assert len(active) == 11 and active[5].op_id == "transition"  # the middle op of every subnet
    small = resmlp.build(input_shape=(64,), num_classes=3, widths=[8, 4], blocks=[1, 0])
    assert small.space().labels == ("a0", "fork_l", "fork_r")
    assert {s.op_id: s.spec.kwargs() for s in small.slots()}["transition"] == dict(d_in=8, d_out=4)


def test_resmlp_every_sampled_arch_trains() -> None:
    """Fair rounds (every candidate of every slot) and the extremes: forward, backward, finite
    gradients on every op with weights that ran (the ``none`` branch passes none back)."""
    from search.samplers import make_sampler

    graph, net = make("resmlp")
    net.train()
    x, y = data()
    sampler = make_sampler("fair", graph.space(), SEED)
    extremes = [Arch({**{l: "skip" for l in ("a0", "a1", "a2", "a3", "b0")}, "fork_l": "none", "fork_r": "none"}),
                Arch({l: "mlp" for l in graph.space().labels})]
    for arch in [sampler.next() for _ in range(12)] + extremes:
        net.zero_grad(set_to_none=True)
        loss = classification_loss(net(x, arch, step=1, microbatch=0), y, len(x))
        loss.backward()
        assert torch.isfinite(loss), arch
        ran = {op.op_id for op in graph.active_ops(arch)}
        for name, p in net.named_parameters():
            if p.grad is not None:
                assert torch.isfinite(p.grad).all(), (arch, name)
        assert {"stem", "transition", "head"} <= ran
        assert all(net.ops[o].fc.weight.grad is not None for o in ("stem", "transition", "head")), arch


def test_resmlp_shared_ops_include_the_mid_graph_transition() -> None:
    from pipeline.shared import shared_ops_of

    graph = resmlp.build(input_shape=SHAPE, num_classes=CLASSES)
    assert shared_ops_of(graph) == {"stem", "transition", "head"}  # merge is a stateless sum


@pytest.mark.parametrize("microbatch", [4, 16])
def test_resmlp_transition_lands_on_either_stage_of_two(microbatch: int) -> None:
    """The exact 2-stage partition of the planner's cost model (analytic costs, as the lookahead
    plans) puts ``transition`` on stage 0 for some subnets and on stage 1 for others: a test of
    shared ops that move between stages can use this space."""
    from pipeline.plan.costs import analytic_costs, subnet_problem
    from pipeline.plan.partition import solve

    graph = resmlp.build(input_shape=SHAPE, num_classes=CLASSES)
    table = analytic_costs(graph, SHAPE, microbatch, "sgd")

    def stage_of_transition(arch: Arch) -> int:
        active = graph.active_ops(arch)
        part = solve(subnet_problem(graph, active, table, 2, 4, "1f1b", 1e9, 5e-5))
        return part.assignment([op.op_id for op in active])["transition"]

    light_first = Arch({**{f"a{i}": "skip" for i in range(4)}, "b0": "mlp", "fork_l": "mlp", "fork_r": "mlp"})
    heavy_first = Arch({**{f"a{i}": "mlp" for i in range(4)}, "b0": "skip", "fork_l": "none", "fork_r": "none"})
    assert stage_of_transition(light_first) == 0 and stage_of_transition(heavy_first) == 1
    space = graph.space()
    rng = random.Random(3)
    stages = [stage_of_transition(space.random(rng)) for _ in range(40)]
    assert 0 < sum(stages) < len(stages), stages  # both stages among random subnets


def test_importing_any_space_registers_every_space_op() -> None:
    code = (
        "import supernet.spaces.cell\n"
        "from supernet import registered_ops\n"
        "ops = set(registered_ops())\n"
        "want = {'tf_attn', 'tf_lightconv', 'mbconv', 'spos_head', 'nb201_relu_conv_bn', 'identity'}\n"
        "assert want <= ops, sorted(want - ops)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert {"tf_stem", "spos_stem", "nb201_stem"} <= set(registered_ops())


@pytest.mark.parametrize("space", sorted(SMALL))
def test_same_options_same_graph_same_weights(space: str) -> None:
    (g1, n1), (g2, n2) = make(space), make(space)
    assert g1.slots() == g2.slots()
    s1, s2 = n1.state_dict(), n2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_hydra_style_options() -> None:
    """YAML lists arrive as ListConfig; ``_target_`` names a space's build function."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "_target_": "supernet.spaces.conv.build", "input_shape": [1, 8, 8], "num_classes": 10,
        "channels": [4, 8, 8], "downsample_at": [1, 2], "kernels": [3], "expansions": [1, 2],
    })
    g = instantiate(cfg)
    assert g.space().choice("layer03").values == ("k3e1", "k3e2", "skip")
    x, _ = data(2)
    assert Supernet(g)(x, g.space().random(random.Random(0))).shape == (2, 10)


# -- the NASPipe preset --------------------------------------------------------------------
def test_naspipe_preset_builds_specs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_modules(self: nn.Module, *a: object, **k: object) -> None:
        raise AssertionError("building a graph must not instantiate any nn.Module")

    monkeypatch.setattr(nn.Module, "__init__", no_modules)
    g = transformer.build(input_shape=SHAPE, num_classes=CLASSES, preset="naspipe")
    monkeypatch.undo()
    space = g.space()
    assert len(space) == 48 and space.labels[0] == "layer00" and space.labels[-1] == "layer47"
    assert all(len(c.values) == 24 and c.values == transformer.NASPIPE_CANDIDATES for c in space.choices)
    assert len(set(transformer.NASPIPE_CANDIDATES)) == 24
    slots = g.slots()
    assert len(slots) == 48 * 24 + 2 and all(isinstance(s.spec, OpSpec) for s in slots)
    assert {s.spec.kwargs()["width"] for s in slots} == {1024}
    assert space.size() == 24**48


def test_naspipe_preset_keeps_explicit_layers_and_width() -> None:
    g = transformer.build(input_shape=SHAPE, num_classes=CLASSES, preset="naspipe", layers=3, width=64)
    assert len(g.space()) == 3
    assert {s.spec.kwargs()["width"] for s in g.slots()} == {64}


def test_every_naspipe_candidate_runs_and_extracts_exactly() -> None:
    graph, net = make("transformer", preset="naspipe", candidates=None, layers=2, width=16)
    net.eval()
    x, _ = data(3)
    for name in transformer.NASPIPE_CANDIDATES:
        arch = Arch({"layer00": name, "layer01": name})
        out = net(x, arch)
        assert out.shape == (3, CLASSES) and torch.isfinite(out).all(), name
        assert torch.equal(out, net.extract(arch)(x)), name


# -- option checks -------------------------------------------------------------------------
BAD_OPTIONS = [
    ("transformer", dict(width=30, candidates=["attn4"]), ["'attn4'", "width=30", "divide"]),
    ("transformer", dict(width=30, candidates=["lightconv3h4"]), ["'lightconv3h4'", "divide"]),
    ("transformer", dict(layers=0), ["transformer.layers", "found 0"]),
    ("transformer", dict(width=2.5), ["transformer.width", "2.5"]),
    ("transformer", dict(candidates=["attn3x"]), ["transformer.candidates", "unknown candidate 'attn3x'"]),
    ("transformer", dict(candidates=["conv4"]), ["'conv4'", "odd"]),
    ("transformer", dict(candidates=["ffn0"]), ["'ffn0'", "mult"]),
    ("transformer", dict(candidates="attn2"), ["transformer.candidates", "list"]),
    ("transformer", dict(candidates=["glu", "glu"]), ["transformer.candidates", "distinct"]),
    ("transformer", dict(preset="nasbench"), ["transformer.preset", "'naspipe'", "'nasbench'"]),
    ("transformer", dict(preset="naspipe", candidates=["glu"]), ["transformer.candidates", "preset"]),
    ("transformer", dict(dropout=1.0), ["transformer.dropout", "[0.0, 1.0)"]),
    ("transformer", dict(widht=32), ["unknown option 'widht'", "Did you mean 'width'"]),
    ("transformer", dict(input_shape=(64,)), ["transformer.input_shape", "(64,)"]),
    ("transformer", dict(num_classes=0), ["transformer.num_classes"]),
    ("conv", dict(downsample_at=[4]), ["conv.downsample_at", "[0, 3]", "[4]"]),
    ("conv", dict(downsample_at=[1, 1]), ["conv.downsample_at", "distinct"]),
    ("conv", dict(channels=[8]), ["conv.channels", "2 positive ints", "[8]"]),
    ("conv", dict(channels="wide"), ["conv.channels", "'wide'"]),
    ("conv", dict(kernels=[3, 4]), ["conv.kernels", "odd", "[3, 4]"]),
    ("conv", dict(expansions=[]), ["conv.expansions", "non-empty"]),
    ("conv", dict(allow_skip="yes"), ["conv.allow_skip", "'yes'"]),
    ("conv", dict(input_shape=(8, 8)), ["conv.input_shape", "(8, 8)"]),
    ("cell", dict(channels=0), ["cell.channels", "found 0"]),
    ("cell", dict(cells=1.5), ["cell.cells", "1.5"]),
    ("cell", dict(cells=True), ["cell.cells", "True"]),
    ("cell", dict(depth=3), ["unknown option 'depth'", "'cells'"]),
    ("resmlp", dict(widths=[16]), ["resmlp.widths", "two ints", "[16]"]),
    ("resmlp", dict(widths=[16, 0]), ["resmlp.widths", ">= 1", "0"]),
    ("resmlp", dict(blocks=[2, -1]), ["resmlp.blocks", ">= 0", "-1"]),
    ("resmlp", dict(blocks="4,1"), ["resmlp.blocks", "'4,1'"]),
    ("resmlp", dict(width=16), ["unknown option 'width'", "Did you mean 'widths'"]),
    ("resmlp", dict(num_classes=0), ["resmlp.num_classes"]),
]


@pytest.mark.parametrize("space, options, fragments", BAD_OPTIONS)
def test_bad_options_name_the_option(space: str, options: dict, fragments: Sequence[str]) -> None:
    kw = {"input_shape": SHAPE, "num_classes": CLASSES, **options}
    with pytest.raises(SupernetError) as e:
        build_space(space, **kw)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_unknown_space_lists_the_known_ones() -> None:
    with pytest.raises(SupernetError, match=r"unknown search space 'resnet'.*\['cell', 'conv', 'resmlp', 'transformer'\]"):
        build_space("resnet", input_shape=SHAPE, num_classes=CLASSES)


def test_wrong_input_shape_at_forward_says_what_was_expected() -> None:
    graph, net = make("transformer")
    with pytest.raises(SupernetError, match=r"expected input of shape \(batch, 1, 8, 8\), found \(2, 1, 8, 7\)"):
        net(torch.zeros(2, 1, 8, 7), archs(graph, 1)[0])


# -- supernet == extracted subnet ----------------------------------------------------------
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("space", sorted(SMALL))
def test_supernet_equals_extracted_subnet(space: str, training: bool) -> None:
    graph, net = make(space)
    net.train(training)
    x, _ = data()
    for arch in archs(graph):
        sub = net.extract(arch)
        assert sub.training == training
        out = net(x, arch, step=5, microbatch=2)
        assert out.shape == (len(x), CLASSES)
        assert torch.equal(out, sub(x, step=5, microbatch=2)), arch


def test_dropout_is_derived_from_step_and_microbatch() -> None:
    graph, net = make("transformer", candidates=["ffn2", "glu"], dropout=0.5)
    net.train()
    x, _ = data()
    arch = archs(graph, 1)[0]
    a = net(x, arch, step=3, microbatch=1)
    torch.manual_seed(12345)  # the global RNG plays no part
    assert torch.equal(a, net(x, arch, step=3, microbatch=1))
    assert not torch.equal(a, net(x, arch, step=4, microbatch=1))
    assert not torch.equal(a, net(x, arch, step=3, microbatch=0))
    net.eval()
    assert torch.equal(net(x, arch, step=3, microbatch=1), net(x, arch, step=4, microbatch=0))


@pytest.mark.parametrize("space", sorted(SMALL))
def test_extracted_parameters_are_copies(space: str) -> None:
    graph, net = make(space)
    net.eval()
    x, _ = data()
    arch = archs(graph, 1)[0]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    out = net(x, arch)
    sub = net.extract(arch)
    assert sum(p.numel() for p in sub.parameters()) > 0
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(net(x, arch), out)
    assert not torch.equal(sub(x), out)


# -- the per-op executor -------------------------------------------------------------------
def bound_variants(n: int, every_cut: bool = False) -> list[list[int]]:
    """Cut bounds for ``n`` active ops: one slice, two, three, and ones with empty slices."""
    twos = range(0, n + 1) if every_cut else sorted({1, n // 2, n - 1})
    out = [[0, n]] + [[0, k, n] for k in twos]
    out += [[0, n // 3, 2 * n // 3, n], [0, 1, n - 1, n], [0, 0, n // 2, n], [0, n // 2, n // 2, n], [0, 2, 3, 5, n]]
    return out


def run_sliced(net: Supernet, arch: Arch, x: torch.Tensor, y: torch.Tensor, bounds: list[int],
               step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss, logits and parameter grads from running the subnet slice by slice."""
    net.zero_grad(set_to_none=True)
    slices = cut(net.graph.active_ops(arch), bounds, net.graph.output)
    runs = [
        SliceRun(sl, module=lambda op_id: net.ops[op_id],
                 ctx=lambda op_id: OpContext(net.seed, step, mb, op_id, net.training))
        for sl in slices
    ]
    acts: list[torch.Tensor] = [x]
    for run in runs:
        acts = run.forward(acts)
    (logits,) = acts
    loss, grad = loss_and_grad(logits, y, len(x))
    grads: list[torch.Tensor | None] = [grad]
    for run in reversed(runs):
        grads = run.backward(grads)
    assert grads == [None]  # the data needs no gradient
    return loss, logits.detach(), {k: p.grad for k, p in net.named_parameters()}


@pytest.mark.parametrize("space", sorted(SMALL))
def test_executor_cuts_agree_bitwise_and_match_autograd(space: str) -> None:
    graph, net = make(space)
    net.train()
    x, y = data()
    for arch in archs(graph):
        n = len(graph.active_ops(arch))
        ref_loss, ref_logits, ref_grads = run_sliced(net, arch, x, y, [0, n], step=7, mb=3)
        assert any(g is not None for g in ref_grads.values())
        for bounds in bound_variants(n, every_cut=space == "cell"):
            loss, logits, grads = run_sliced(net, arch, x, y, bounds, step=7, mb=3)
            assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits), bounds
            for k, g in grads.items():
                r = ref_grads[k]
                assert (g is None) == (r is None), (bounds, k)
                assert g is None or torch.equal(g, r), (bounds, k)

        net.zero_grad(set_to_none=True)
        logits = net(x, arch, step=7, microbatch=3)
        loss = classification_loss(logits, y, len(x))
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-6, rtol=1e-5)
        for k, p in net.named_parameters():
            r = ref_grads[k]
            assert (p.grad is None) == (r is None), k
            if r is not None:
                torch.testing.assert_close(p.grad, r, atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_executor_relays_cell_nodes_across_cuts() -> None:
    """A cut inside a cell must hand on every node a later edge still reads."""
    graph, _ = make("cell")
    arch = Arch({l: "conv3x3" for l in graph.space().labels})
    active = graph.active_ops(arch)
    at = [op.node for op in active].index("c0_e2_1")  # stem and c0_n1 are read after the cut
    first, second = cut(active, [0, at, len(active)], graph.output)
    assert first.outputs == ("stem", "c0_n1", "c0_e2_0")  # c0_e2_0 waits for c0_e2_1 at c0_n2
    assert second.inputs == first.outputs and second.outputs == ("head",)
    assert INPUT not in second.inputs


def test_executor_rejects_bad_bounds() -> None:
    graph, _ = make("conv")
    active = graph.active_ops(archs(graph, 1)[0])
    with pytest.raises(SupernetError, match="cut bounds"):
        cut(active, [0, 3, 2, len(active)], graph.output)
    with pytest.raises(SearchSpaceError):
        graph.active_ops(Arch({"layer00": "skip"}))
