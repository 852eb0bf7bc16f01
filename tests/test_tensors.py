"""The tensor manager: an op's weights and optimizer state leave and arrive together."""
from __future__ import annotations

import pytest
import torch

from pipeline.memory import OptimConfig, TensorManager, params_digest
from supernet import OpContext, OpSpec, SupernetGraph


def graph() -> SupernetGraph:
    g = SupernetGraph("t")
    g.add_fixed("stem", OpSpec.of("linear", d_in=8, d_out=8), ["input"])
    g.add_choice("l0", {"a": OpSpec.of("mlp", d=8, hidden=16), "b": OpSpec.of("identity")}, ["stem"])
    return g


def train(tm: TensorManager, op_id: str, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        tm.module(op_id)(x, ctx=OpContext(0, 0, 0, op_id, True)).square().sum().backward()
        tm.step([op_id], lr=0.1)


def migrate(src: TensorManager, dst: TensorManager, op_id: str, weights_only: bool = False) -> None:
    state = src.export(op_id)
    if weights_only:
        state = {k: v for k, v in state.items() if not k.startswith("optim/")}
    dst.adopt(op_id, state)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_migration_carries_optimizer_state(optim: str) -> None:
    cfg = OptimConfig(name=optim, lr=0.1, momentum=0.9, weight_decay=0.01)
    stay = TensorManager(graph(), 0, cfg, own=["l0/a"])
    a, b = TensorManager(graph(), 0, cfg, own=["l0/a"]), TensorManager(graph(), 0, cfg)
    train(stay, "l0/a", 3, seed=1)
    train(a, "l0/a", 3, seed=1)
    migrate(a, b, "l0/a")
    assert not a.owns("l0/a") and b.owns("l0/a"), "an op must have exactly one owner"
    train(stay, "l0/a", 2, seed=2)
    train(b, "l0/a", 2, seed=2)
    assert params_digest({"l0/a": stay.export("l0/a", release=False)}) == \
        params_digest({"l0/a": b.export("l0/a", release=False)})


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_moving_only_the_weights_is_detected(optim: str) -> None:
    """The check above fails if migration dropped the optimizer state."""
    cfg = OptimConfig(name=optim, lr=0.1, momentum=0.9)
    stay = TensorManager(graph(), 0, cfg, own=["l0/a"])
    a, b = TensorManager(graph(), 0, cfg, own=["l0/a"]), TensorManager(graph(), 0, cfg)
    train(stay, "l0/a", 3, seed=1)
    train(a, "l0/a", 3, seed=1)
    migrate(a, b, "l0/a", weights_only=True)
    train(stay, "l0/a", 2, seed=2)
    train(b, "l0/a", 2, seed=2)
    assert params_digest({"l0/a": stay.export("l0/a", release=False)}) != \
        params_digest({"l0/a": b.export("l0/a", release=False)})


def test_an_op_cannot_be_owned_twice() -> None:
    tm = TensorManager(graph(), 0, OptimConfig(), own=["stem"])
    with pytest.raises(RuntimeError, match="exactly one owner"):
        tm.create("stem")
    with pytest.raises(KeyError, match="not owned"):
        tm.module("l0/a")


def test_export_names_every_tensor() -> None:
    tm = TensorManager(graph(), 0, OptimConfig(name="adamw"), own=["l0/a"])
    train(tm, "l0/a", 1, seed=0)
    keys = set(tm.export("l0/a", release=False))
    assert {"param/fc1.weight", "param/fc2.bias", "optim/0/exp_avg", "optim/3/exp_avg_sq", "optim/1/step"} <= keys
