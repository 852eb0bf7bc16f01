"""The shared-op modes against an oracle written apart from the engines (tests/oracle.py).

The reference and the pipelined engine run the same shared-op code (``pipeline/shared.py``) and
are tested equal to each other, so those tests cannot tell a fault in the delayed mode from the
cost of staleness. Here a plain PyTorch loop that states the semantics directly (every version of
the shared ops kept, the read version computed from the step, the delay and the last checkpoint
boundary) must compute the engine's bits: every step's and micro-batch's loss and every op's
final weights, buffers and optimizer state, compared with ``torch.equal``. The oracle also runs
with the wrong delay and without the boundary to show these comparisons can fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import Scenario, arch_stream, build_graph, run_scenario, spawn, step_data
from oracle import OracleRun, cosine_lr, shared_ops, train
from pipeline import OptimConfig, params_digest
from search.app import prepare, run
from search.checkpoint import load_checkpoint
from supernet import Arch, build_op
from test_app import make_cfg


def scenario(space: str, mode: str, delay: int = 1, every: int = 0, steps: int = 8, optimizer: str = "sgd",
             sampler: str = "random", window: int = 2, segment: int | None = None) -> Scenario:
    extra: dict = {"window": window, "shared_ops": mode, **({"shared_delay": delay} if mode == "delayed" else {})}
    if window > 1:
        extra.update(eps=0.0, objective="minmax")  # (pipelined: ops follow every change of the optimum)
    return Scenario(space, "1f1b", steps=steps, optimizer=optimizer, checkpoint_every=every, sampler=sampler,
                    segment=steps if segment is None else segment, extra=extra)


def oracle(sc: Scenario, mode: str | None = None, delay: int | None = None, every: int | None = None) -> OracleRun:
    """The oracle on ``sc``'s subnets, data and hyper-parameters (tests/distributed.py
    ``make_engine``); ``mode``, ``delay`` and ``every`` override ``sc``'s (to get it wrong)."""
    graph = build_graph(sc.space)
    archs = arch_stream(graph, sc.seed, sc.steps, sc.sampler, sc.order)
    items = [(k, archs[k], *step_data(sc.seed, k, sc.batch)) for k in range(sc.steps)]
    optim = OptimConfig(name=sc.optimizer, lr=0.05 if sc.optimizer == "sgd" else 3e-3, momentum=0.9, weight_decay=1e-4)
    return train(graph, sc.seed, items, optim=optim, lr=cosine_lr(optim.lr, sc.steps, warmup_steps=1),
                 microbatches=sc.microbatches, mode=mode or sc.extra.get("shared_ops", "exact"),
                 delay=sc.extra.get("shared_delay", 0) if delay is None else delay,
                 checkpoint_every=sc.checkpoint_every if every is None else every)


_ENGINE: dict[str, tuple[dict, dict]] = {}


def engine(sc: Scenario) -> tuple[dict, dict]:
    """The one-process engine on ``sc``: its results and final op states (once per scenario)."""
    key = repr(sc)
    if key not in _ENGINE:
        torch.set_num_threads(1)
        res = run_scenario(sc)
        _ENGINE[key] = res, res.pop("engine").op_states()
    return _ENGINE[key]


def assert_same_states(got: dict, want: dict, label: str) -> None:
    assert sorted(got) == sorted(want), f"{label}: ops differ"
    for op in want:
        assert sorted(got[op]) == sorted(want[op]), f"{label}: op {op}: state keys differ"
        bad = [k for k in want[op] if not torch.equal(got[op][k], want[op][k])]
        assert not bad, f"{label}: op {op}: {bad} differ from the oracle's"


def assert_matches(sc: Scenario, run_: OracleRun, label: str) -> None:
    res, states = engine(sc)
    assert res["mb_losses"] == [list(mb) for mb in run_.losses], f"{label}: micro-batch losses differ"
    assert res["losses"] == run_.step_losses, f"{label}: step losses differ"
    assert_same_states(states, run_.states, label)


DELAYED = [
    scenario("conv", "delayed", delay=1, every=4, steps=9),
    scenario("conv", "delayed", delay=2, every=4, steps=10, sampler="fair"),
    scenario("conv", "delayed", delay=3, every=6, steps=10),
    scenario("transformer", "delayed", delay=2, every=3, steps=7, optimizer="adamw"),  # dropout, no buffers
]


def _case(sc: Scenario) -> str:
    return f"{sc.space}-D{sc.extra['shared_delay']}-ckpt{sc.checkpoint_every}"


@pytest.mark.parametrize("sc", DELAYED, ids=_case)
def test_delayed_engine_is_the_oracle_bit_for_bit(sc: Scenario) -> None:
    D, every = sc.extra["shared_delay"], sc.checkpoint_every
    run_ = oracle(sc)
    # the reads this case covers: D updates late, restarting at the boundary inside the run
    assert run_.reads == [max(t - D, t // every * every) - 1 for t in range(sc.steps)]
    assert 0 < every < sc.steps - 1 and run_.reads[every] == every - 1 > every - D - 1
    assert_matches(sc, run_, f"{sc.space} D={D}")

    # not vacuous: staleness changes the losses, and a wrong delay or boundary (where it reads
    # other versions: here D + 1 reads what D does when boundaries are close) would be caught
    res, _ = engine(sc)
    assert oracle(sc, mode="exact").losses != run_.losses
    for wrong in (dict(delay=D - 1) if D > 1 else dict(mode="exact"), dict(delay=D + 1), dict(every=0)):
        other = oracle(sc, **wrong)
        if other.reads != run_.reads:
            assert other.step_losses != res["losses"], f"the oracle with {wrong} matches too"


@pytest.mark.parametrize("window", [1, 3])
def test_exact_engine_is_the_oracle_without_delay(window: int) -> None:
    """``exact`` (flushed, or several subnets in flight) is sequential training: the oracle's D = 0."""
    sc = scenario("conv", "exact", steps=6, every=4, window=window)
    run_ = oracle(sc)
    assert run_.reads == [t - 1 for t in range(sc.steps)]
    assert_matches(sc, run_, f"exact window={window}")


@pytest.mark.parametrize("space,optimizer", [("conv", "sgd"), ("transformer", "adamw")])
def test_frozen_engine_is_the_oracle_and_keeps_shared_ops_initial(space: str, optimizer: str) -> None:
    sc = scenario(space, "frozen", steps=6, optimizer=optimizer)
    run_ = oracle(sc)
    assert_matches(sc, run_, f"frozen {space}")
    _, states = engine(sc)
    graph = build_graph(space)
    shared = shared_ops(graph)
    assert shared == {"stem", "head"}
    for slot in graph.slots():
        initial = build_op(slot.spec, slot.op_id, sc.seed)
        first = dict(initial.named_parameters())
        changed = any(not torch.equal(states[slot.op_id][f"param/{n}"], p) for n, p in first.items())
        if slot.op_id in shared:  # weights and buffers as built, no optimizer state
            assert not changed and not any(k.startswith("optim/") for k in states[slot.op_id])
            for n, b in initial.named_buffers():
                assert torch.equal(states[slot.op_id][f"buffer/{n}"], b)
    trained = [op for op in states if any(k.startswith("optim/") for k in states[op])]
    assert trained and not set(trained) & shared


def test_delayed_batchnorm_statistics_replace_the_live_ones() -> None:
    """What ``pipeline/shared.py`` documents for buffers, seen from outside: a step's batch-norm
    statistics start from the version it read and replace the op's, so the counts of the
    stem's batch norm follow the chain of reads (the subnets in between are not counted)."""
    sc = DELAYED[0]
    run_ = oracle(sc)
    count = {-1: 0}
    for t, r in enumerate(run_.reads):
        count[t] = count[r] + sc.microbatches
    _, states = engine(sc)
    tracked = states["stem"]["buffer/bn.num_batches_tracked"]
    assert int(tracked) == count[sc.steps - 1] < sc.microbatches * sc.steps
    assert torch.equal(tracked, run_.states["stem"]["buffer/bn.num_batches_tracked"])


def test_app_delayed_run_is_the_oracle(tmp_path: Path) -> None:
    """The public entry (``search.app.run``): D = 2, checkpoints every 5 of 12 steps, the app's
    own data, sampler, Nesterov SGD and warm-up; its metrics and final checkpoint are the oracle's."""
    cfg = make_cfg("pipeline.window=3", "pipeline.shared_ops=delayed", "pipeline.shared_delay=2", "sampler=fair")
    p = prepare(cfg, output_dir=tmp_path)
    run(cfg, output_dir=tmp_path, prepared=p)
    t = p.rc.train
    assert (t.checkpoint_every, t.steps) == (5, 12)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    items = [(m["step"], Arch(m["arch"]), *p.data.train_batch(m["step"], t.batch_size)) for m in metrics]
    run_ = train(p.graph, p.rc.seed, items, optim=t.optimizer,
                 lr=cosine_lr(t.optimizer.lr, t.steps, t.warmup_steps, t.lr_schedule, t.min_lr),
                 microbatches=t.microbatches, mode="delayed", delay=2, checkpoint_every=t.checkpoint_every)
    assert [m["loss"] for m in metrics] == run_.step_losses
    assert [m["lr"] for m in metrics] == [cosine_lr(t.optimizer.lr, t.steps, t.warmup_steps, t.lr_schedule,
                                                    t.min_lr)(k) for k in range(t.steps)]
    assert_same_states(load_checkpoint(tmp_path / "checkpoint.pt").op_states, run_.states, "app")


@pytest.mark.dist
def test_pipelined_delayed_engine_is_the_oracle() -> None:
    """P = 2 gloo ranks, several subnets in flight, ops migrating: the oracle's bits too."""
    scs = [scenario("conv", "delayed", delay=2, every=4, steps=10, sampler="fair", window=4, segment=4),
           scenario("transformer", "delayed", delay=1, every=3, steps=7, optimizer="adamw", window=3)]
    results, _, _ = spawn(2, scs, timeout_s=300)
    for sc, got in zip(scs, results):
        run_ = oracle(sc)
        label = f"P=2 {sc.space} D={sc.extra['shared_delay']}"
        assert got["mb_losses"] == [list(mb) for mb in run_.losses], f"{label}: micro-batch losses differ"
        assert got["losses"] == run_.step_losses, f"{label}: step losses differ"
        assert got["digest"] == params_digest(run_.states), f"{label}: final weights differ"
        assert got["overlapped"] > 0, f"{label}: no subnet began before the one before ended"
