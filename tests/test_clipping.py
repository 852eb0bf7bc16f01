"""``train.clip_grad_norm``: the subnet's gradients clipped to a global L2 norm, the same bits in
every layout.

* The reference engine against the oracle (tests/oracle.py, plain PyTorch, nothing from
  ``pipeline``) with the rule written here once more: per op a float64 sum of squares (each
  gradient's float64 L2 norm, squared), added in op order, ``scale = max_norm / (norm + 1e-6)``
  when below 1. The norm is also checked against
  torch's own ``get_total_norm``, and clipping must trigger.
* The reference's delayed shared ops with clipping against the delayed oracle with the rule.
* One process against P = 2 flushed stages (ops migrating; a tensor-manager budget with host
  updates too), the (1, 2) and the (2, 2) mesh, and cross-subnet schedules at P = 2 and 3 and on
  both meshes (windows, delayed / frozen shared ops, the B/W split, a budget; each stage's sums
  travel as the schedule's ``norm`` messages, with replicas after the fold at the subnet's last
  backward): the same losses and ``params_digest``.
* The config: a bad value and the combination refused (``dc`` compensation in a pipeline).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import oracle as oracle_module
from distributed import Scenario, assert_same_as_reference, build_graph, one_process, spawn
from search.config import ConfigError, load_config, train_fields
from test_config import make_cfg
from test_delayed_oracle import assert_same_states, engine, oracle, scenario
from test_memory_pipeline import budgeted

CLIP = 0.5  # below the conv space's gradient norms early on (checked): clipping triggers
MIGRATING = {"eps": 0.0, "objective": "minmax"}


class _ClippedOptimizer:
    """The oracle's optimizer with clipping before each step: ``ops`` are every op's module in
    the graph's slot order (an op outside the subnet has no gradient and adds an exact 0)."""

    def __init__(self, opt: torch.optim.Optimizer, ops: list, max_norm: float, norms: list[float]) -> None:
        self.opt, self.ops, self.max_norm, self.norms = opt, ops, max_norm, norms
        self.param_groups, self.state = opt.param_groups, opt.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        total = 0.0
        for m in self.ops:
            s = torch.zeros((), dtype=torch.float64)
            for p in m.parameters():
                if p.grad is not None:
                    s = s + torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
            total += s.item()
        norm = math.sqrt(total)
        grads = [p.grad for m in self.ops for p in m.parameters() if p.grad is not None]
        assert norm == pytest.approx(float(torch.nn.utils.get_total_norm(grads)), rel=1e-5)  # the standard norm
        self.norms.append(norm)
        coef = self.max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        self.opt.step()


def clipped_oracle(sc: Scenario, monkeypatch: pytest.MonkeyPatch) -> tuple[oracle_module.OracleRun, list[float]]:
    built: list = []
    norms: list[float] = []
    n = len(build_graph(sc.space).slots())
    build, make = oracle_module.build_op, oracle_module._optimizer

    def recording_build(*args, **kwargs):
        m = build(*args, **kwargs)
        built.append(m)
        return m

    monkeypatch.setattr(oracle_module, "build_op", recording_build)
    monkeypatch.setattr(oracle_module, "_optimizer",
                        lambda optim, params: _ClippedOptimizer(make(optim, params), built[:n], sc.clip, norms))
    run = oracle(sc)
    monkeypatch.undo()
    return run, norms


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_reference_engine_clips_as_plain_pytorch(optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = Scenario("conv", "1f1b", steps=5, optimizer=optimizer, clip=CLIP)
    graph = build_graph(sc.space)
    order = [s.op_id for s in graph.slots()]
    arch = graph.space().random(__import__("random").Random(0))
    active = [op.op_id for op in graph.active_ops(arch)]
    assert active == [o for o in order if o in set(active)], "premise: slot order restricted to a subnet = op order"
    want, norms = clipped_oracle(sc, monkeypatch)
    assert sum(nm > CLIP for nm in norms) >= 3, f"clipping should trigger: norms {norms}"
    res, states = engine(sc)
    assert res["mb_losses"] == [list(mb) for mb in want.losses], "micro-batch losses differ from the oracle's"
    assert_same_states(states, want.states, f"clip {optimizer}")
    plain = oracle(dataclasses.replace(sc, clip=None))
    assert plain.losses != want.losses, "clipping changed nothing: the comparison would not cover it"


P2 = [
    Scenario("conv", "1f1b", steps=5, extra=MIGRATING, clip=CLIP),
    Scenario("transformer", "gpipe", steps=4, optimizer="adamw", extra=MIGRATING, clip=CLIP),
    dataclasses.replace(budgeted(Scenario("conv", "gpipe", steps=4, extra=MIGRATING, clip=CLIP), 2),
                        memory={**budgeted(Scenario("conv", "gpipe", steps=4), 2).memory, "optimizer": "host"}),
    Scenario("conv", "1f1b", steps=4, extra={**MIGRATING, "stages": 1}, clip=CLIP),  # (1, 2): data parallel
    # (1, 2) across subnets: the fold at the update, the norm on the replicas' sum
    Scenario("conv", "1f1b", steps=6, segment=6, sampler="fair", clip=CLIP,
             extra={**MIGRATING, "stages": 1, "window": 4, "shared_ops": "delayed", "shared_delay": 2}),
]
MESH = [Scenario("conv", "1f1b", steps=4, extra={**MIGRATING, "stages": 2}, clip=CLIP),
        Scenario("transformer", "1f1b", steps=4, optimizer="adamw", extra={**MIGRATING, "stages": 2}, clip=CLIP),
        # (2, 2) across subnets: each stage folds a subnet at its last backward, then its sums leave
        Scenario("conv", "1f1b", steps=8, segment=8, sampler="fair", clip=CLIP,
                 extra={**MIGRATING, "stages": 2, "window": 4, "shared_ops": "delayed", "shared_delay": 2}),
        Scenario("transformer", "zbh1", steps=6, segment=6, optimizer="adamw", clip=CLIP,
                 extra={**MIGRATING, "stages": 2, "window": 3})]


def reference(sc: Scenario) -> dict:
    """One process, all resident (the same ``clip``)."""
    extra = {k: v for k, v in sc.extra.items() if k != "stages"}
    return one_process(dataclasses.replace(sc, extra=extra, memory={}))


@pytest.mark.parametrize("mode", ["delayed", "frozen"])
def test_reference_engine_clips_delayed_and_frozen_shared_ops_as_plain_pytorch(mode: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm covers what the update steps: a delayed op's gradient from its stale read, never a
    frozen op's; the delayed oracle with the rule written in this file."""
    sc = dataclasses.replace(scenario("conv", mode, delay=2, every=4, steps=9), clip=CLIP)
    want, norms = clipped_oracle(sc, monkeypatch)
    assert sum(nm > CLIP for nm in norms) >= 3, f"clipping should trigger: norms {norms}"
    res, states = engine(sc)
    assert res["mb_losses"] == [list(mb) for mb in want.losses], f"{mode}: micro-batch losses differ from the oracle's"
    assert_same_states(states, want.states, f"clip {mode}")


CROSS2 = [
    Scenario("conv", "1f1b", steps=8, segment=8, sampler="fair", clip=CLIP,
             extra={**MIGRATING, "window": 4, "shared_ops": "delayed", "shared_delay": 2}),
    Scenario("transformer", "zbh1", steps=6, segment=6, optimizer="adamw", clip=CLIP,
             extra={**MIGRATING, "window": 3, "shared_ops": "delayed", "shared_delay": 1}),
    Scenario("conv", "1f1b", steps=6, segment=3, clip=CLIP, extra={**MIGRATING, "window": 4}),
    # (the cell's gradients are smaller: a lower bound makes clipping trigger)
    Scenario("cell", "1f1b", steps=6, segment=6, clip=0.05, extra={**MIGRATING, "window": 3, "shared_ops": "frozen"}),
    budgeted(Scenario("conv", "1f1b", steps=6, segment=6, clip=CLIP,
                      extra={**MIGRATING, "window": 4, "shared_ops": "delayed", "shared_delay": 1}), 2),
]
CROSS3 = [Scenario("conv", "1f1b", steps=8, segment=8, sampler="fair", clip=CLIP,
                   extra={**MIGRATING, "window": 4, "shared_ops": "delayed", "shared_delay": 1}),
          Scenario("transformer", "zbh1", steps=6, segment=6, optimizer="adamw", clip=CLIP,
                   extra={**MIGRATING, "window": 4})]


@pytest.mark.dist
@pytest.mark.parametrize("world,scenarios", [(2, P2), (4, MESH), (2, CROSS2), (3, CROSS3)],
                         ids=["P2-and-1x2", "2x2", "P2-cross", "P3-cross"])
def test_clipped_layouts_are_bit_identical_to_one_process(world: int, scenarios: list[Scenario]) -> None:
    results, _, _ = spawn(world, scenarios, timeout_s=300)
    for sc, got in zip(scenarios, results):
        stages = sc.extra.get("stages", world)
        label = f"{sc.space}/{sc.schedule}/{sc.optimizer} world {world} stages {stages} {sc.extra} {sc.memory}"
        ref = reference(sc)
        assert_same_as_reference(got, ref, label)
        unclipped = reference(dataclasses.replace(sc, clip=None))
        assert unclipped["losses"] != ref["losses"], f"{label}: clipping should change the run"
    if scenarios is P2:
        assert sum(results[2]["host_updates"]) > 0 and sum(results[2]["evictions"]) > 0, "the budget should bite"
    if scenarios is CROSS2:
        assert sum(results[-1]["evictions"]) > 0, "the budget should bite"


def test_config_reads_checks_and_digests_clip_grad_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config(make_cfg()).train.clip_grad_norm is None
    assert load_config(make_cfg("train.clip_grad_norm=1.5")).train.clip_grad_norm == 1.5
    for bad in ("-1", "0", "nan", "abc"):
        with pytest.raises(ConfigError, match="train.clip_grad_norm"):
            load_config(make_cfg(f"train.clip_grad_norm={bad}"))
    for cross in ("pipeline.window=2", "pipeline.shared_ops=delayed", "pipeline.shared_ops=frozen"):
        load_config(make_cfg("train.clip_grad_norm=1.0", cross))  # one process, or one stage per process
        monkeypatch.setenv("WORLD_SIZE", "4")
        load_config(make_cfg("train.clip_grad_norm=1.0", cross))
        load_config(make_cfg("train.clip_grad_norm=1.0", cross, "pipeline.stages=2"))  # replicated stages
        with pytest.raises(ConfigError, match=r"^train.clip_grad_norm / pipeline.delay_compensation: found"):
            load_config(make_cfg("train.clip_grad_norm=1.0", "pipeline.shared_ops=delayed",
                                 "pipeline.delay_compensation=dc"))
        monkeypatch.delenv("WORLD_SIZE")
    load_config(make_cfg("train.clip_grad_norm=1.0", "pipeline.shared_ops=delayed", "pipeline.delay_compensation=dc"))
    # null is left out of the train digest (older checkpoints keep resuming); a value is in it
    assert "clip_grad_norm" not in train_fields(make_cfg())["train"]
    assert train_fields(make_cfg("train.clip_grad_norm=1.0"))["train"]["clip_grad_norm"] == 1.0
