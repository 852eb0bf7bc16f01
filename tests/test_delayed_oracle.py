"""The shared-op modes against an oracle written apart from the engines (tests/oracle.py).

The reference and the pipelined engine run the same shared-op code (``pipeline/shared.py``) and
are tested equal to each other, so those tests cannot tell a fault in the delayed mode from the
cost of staleness. Here a plain PyTorch loop that states the semantics directly (every version of
the shared ops kept, the read version computed from the step, the delay and the last checkpoint
boundary) must compute the engine's bits: every step's and micro-batch's loss and every op's
final weights, buffers and optimizer state, compared with ``torch.equal``. The oracle also runs
with the wrong delay and without the boundary to show these comparisons can fail. The delay's
compensation (``pipeline.delay_compensation``: ``predict``, the default, ``dc``, ``step``, ``none``)
is stated in the oracle too, and checked the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distributed import Scenario, arch_stream, build_graph, run_scenario, spawn, step_data
from oracle import OracleRun, cosine_lr, shared_ops, train
from pipeline import OptimConfig, PipelineSettings, params_digest
from search.app import prepare, run
from search.checkpoint import load_checkpoint
from supernet import Arch, build_op
from test_app import make_cfg


def scenario(space: str, mode: str, delay: int = 1, every: int = 0, steps: int = 8, optimizer: str = "sgd",
             sampler: str = "random", window: int = 2, segment: int | None = None,
             compensation: tuple[str, float] | None = None, delays: dict[str, int] | None = None) -> Scenario:
    extra: dict = {"window": window, "shared_ops": mode, **({"shared_delay": delay} if mode == "delayed" else {})}
    if delays is not None:
        extra["shared_delays"] = delays
    if compensation is not None:
        extra.update(delay_compensation=compensation[0], delay_compensation_coef=compensation[1])
    if window > 1:
        extra.update(eps=0.0, objective="minmax")  # (pipelined: ops follow every change of the optimum)
    return Scenario(space, "1f1b", steps=steps, optimizer=optimizer, checkpoint_every=every, sampler=sampler,
                    segment=steps if segment is None else segment, extra=extra)


def compensation_of(sc: Scenario) -> tuple[str, float]:
    """``sc``'s ``pipeline.delay_compensation`` and coefficient (the settings' defaults if unset)."""
    default = PipelineSettings()
    return (sc.extra.get("delay_compensation", default.delay_compensation),
            sc.extra.get("delay_compensation_coef", default.delay_compensation_coef))


def oracle(sc: Scenario, mode: str | None = None, delay: int | None = None, every: int | None = None,
           compensation: tuple[str, float] | None = None, delays: dict[str, int] | None = None) -> OracleRun:
    """The oracle on ``sc``'s subnets, data and hyper-parameters (tests/distributed.py
    ``make_engine``); ``mode``, ``delay``, ``every``, ``compensation`` and ``delays`` override
    ``sc``'s (to get it wrong)."""
    rule, coef = compensation if compensation is not None else compensation_of(sc)
    graph = build_graph(sc.space)
    archs = arch_stream(graph, sc.seed, sc.steps, sc.sampler, sc.order)
    items = [(k, archs[k], *step_data(sc.seed, k, sc.batch)) for k in range(sc.steps)]
    optim = OptimConfig(name=sc.optimizer, lr=0.05 if sc.optimizer == "sgd" else 3e-3, momentum=0.9, weight_decay=1e-4)
    return train(graph, sc.seed, items, optim=optim, lr=cosine_lr(optim.lr, sc.steps, warmup_steps=1),
                 microbatches=sc.microbatches, mode=mode or sc.extra.get("shared_ops", "exact"),
                 delay=sc.extra.get("shared_delay", 0) if delay is None else delay,
                 checkpoint_every=sc.checkpoint_every if every is None else every, compensation=rule, coef=coef,
                 delays=sc.extra.get("shared_delays") if delays is None else delays)


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
    # (the cases above run the default rule, ``predict``; staleness alone, no compensation:)
    scenario("conv", "delayed", delay=2, every=4, steps=10, sampler="fair", compensation=("none", 1.0)),
]


def _case(sc: Scenario) -> str:
    return f"{sc.space}-D{sc.extra['shared_delay']}-ckpt{sc.checkpoint_every}-{compensation_of(sc)[0]}"


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


COMPENSATED = [
    scenario("conv", "delayed", delay=2, every=5, steps=10, compensation=("predict", 1.0)),  # SGD, batch norm
    scenario("conv", "delayed", delay=1, every=4, steps=9, sampler="fair", compensation=("predict", 0.5)),
    scenario("transformer", "delayed", delay=3, every=6, steps=10, optimizer="adamw", compensation=("predict", 1.0)),
    scenario("conv", "delayed", delay=2, every=5, steps=10, compensation=("dc", 50.0)),
    scenario("transformer", "delayed", delay=2, every=4, steps=8, optimizer="adamw", compensation=("dc", 2000.0)),
    scenario("conv", "delayed", delay=2, every=5, steps=10, compensation=("step", 0.5)),
]


def _rule_case(sc: Scenario) -> str:
    return f"{sc.space}-D{sc.extra['shared_delay']}-{sc.extra['delay_compensation']}{sc.extra['delay_compensation_coef']}"


@pytest.mark.parametrize("sc", COMPENSATED, ids=_rule_case)
def test_compensated_engine_is_the_oracle_bit_for_bit(sc: Scenario) -> None:
    """``pipeline.delay_compensation``: the oracle's own statement of each rule (weights moved
    on along their last update, DC-ASGD's gradient, a scaled step), bit for bit, across a
    checkpoint boundary (no prediction from a version before it)."""
    rule, coef = compensation_of(sc)
    run_ = oracle(sc)
    assert_matches(sc, run_, f"{sc.space} {rule} {coef}")
    res, _ = engine(sc)
    # not vacuous: the rule changes what is computed, and another coefficient would be caught
    assert oracle(sc, compensation=("none", 1.0)).step_losses != res["losses"]
    assert oracle(sc, compensation=(rule, coef * 0.5)).step_losses != res["losses"]
    # nor the same as predicting across the boundary: the oracle that forgets it differs
    if rule == "predict":
        assert oracle(sc, every=0).step_losses != res["losses"]


OWN_DELAYS = [
    scenario("conv", "delayed", delay=3, every=6, steps=10, delays={"head": 1}),  # predict, batch norm in the stem
    scenario("conv", "delayed", delay=2, every=5, steps=10, sampler="fair", delays={"head": 0},
             compensation=("step", 0.5)),  # the head read exactly: no scaled step there
    scenario("transformer", "delayed", delay=2, every=4, steps=8, optimizer="adamw", delays={"stem": 3, "head": 1},
             compensation=("dc", 2000.0)),
]


@pytest.mark.parametrize("sc", OWN_DELAYS, ids=lambda sc: f"{sc.space}-D{sc.extra['shared_delay']}-"
                         + "-".join(f"{op}{d}" for op, d in sc.extra["shared_delays"].items()))
def test_own_delays_engine_is_the_oracle_bit_for_bit(sc: Scenario) -> None:
    """``pipeline.shared_delays``: each shared op read as late as its own delay says (0: exactly,
    without compensation), the others ``shared_delay`` late."""
    run_ = oracle(sc)
    assert_matches(sc, run_, f"{sc.space} own delays {sc.extra['shared_delays']}")
    res, _ = engine(sc)
    # not vacuous: every op at the run's delay, or the ops' delays swapped, computes other bits
    assert oracle(sc, delays={}).step_losses != res["losses"]
    D = sc.extra["shared_delay"]
    assert oracle(sc, delays={op: D + 1 - d for op, d in sc.extra["shared_delays"].items()}).step_losses != res["losses"]


def test_own_delays_are_checked_against_the_space() -> None:
    from pipeline.shared import SharedOps

    with pytest.raises(ValueError, match=r"pipeline.shared_delays: expected shared ops of this space "
                                         r"\(\['head', 'stem'\]\), found \['tail'\]"):
        SharedOps("delayed", 2, ["stem", "head"], 0, lambda op: None, delays={"tail": 1})
    with pytest.raises(ValueError, match=r"pipeline.shared_delays: expected op ids to integers >= 0, found 'head': -1"):
        PipelineSettings(shared_delays={"head": -1})
    with pytest.raises(ValueError, match=r"pipeline.shared_delays: expected a mapping of op ids to delays, found 3"):
        PipelineSettings(shared_delays=3)
    ops = SharedOps("delayed", 3, ["stem", "head", "mid"], 0, lambda op: None, delays={"head": 0, "mid": 1, "stem": 3})
    assert ops.delayed == {"stem", "mid"} and ops.own_delays == {"mid": 1}
    assert [ops.reads(9, op) for op in ("stem", "mid", "head")] == [5, 7, 8]
    exact = SharedOps("exact", 3, ["stem", "head"], 0, lambda op: None, delays={"head": 1})
    assert exact.delayed == frozenset() and exact.own_delays == {}


def test_predict_reads_the_version_moved_on() -> None:
    """What ``predict`` runs, seen on the weights: a subnet that misses d updates reads
    ``v_r + c*d*(v_r - v_{r-1})`` of the stem, and the version itself where ``v_{r-1}`` is from
    before the boundary (a resumed run has no older one)."""
    from pipeline.shared import SharedOps

    torch.manual_seed(0)
    live = torch.nn.Linear(3, 2)
    ops = SharedOps("delayed", 2, ["stem"], 4, lambda op: live, "predict", 0.5)
    history, v = [], {-1: {n: p.detach().clone() for n, p in live.named_parameters()}}
    for step in range(8):
        ops.begin("stem", step)
        history.append({n: p.detach().clone() for n, p in ops.module("stem", step).named_parameters()})
        with ops.updating(["stem"], step):
            with torch.no_grad():
                for p in live.parameters():
                    p.add_(0.1 * (step + 1))  # an "update" whose size is known
        v[step] = {n: p.detach().clone() for n, p in live.named_parameters()}
    moved = []
    for step, got in enumerate(history):
        r = max(step - 2, step // 4 * 4) - 1
        d = step - 1 - r
        predicted = d > 0 and r - 1 >= step // 4 * 4 - 1
        moved += [step] if predicted else []
        for n, t in got.items():
            want = v[r][n] + (0.5 * d) * (v[r][n] - v[r - 1][n]) if predicted else v[r][n]
            assert torch.equal(t, want), (step, n)
    # steps 5 and 6 read the boundary's version (3) and have no version before it
    assert [max(s - 2, s // 4 * 4) - 1 for s in range(8)] == [-1, -1, -1, 0, 3, 3, 3, 4] and moved == [3, 7]


def test_compensation_setting_is_checked() -> None:
    with pytest.raises(ValueError, match=r"pipeline.delay_compensation: expected one of .*found 'spectrain'"):
        PipelineSettings(delay_compensation="spectrain")
    with pytest.raises(ValueError, match=r"pipeline.delay_compensation_coef: expected a finite number >= 0, found -1"):
        PipelineSettings(delay_compensation="predict", delay_compensation_coef=-1)
    with pytest.raises(ValueError, match=r"delay_compensation_coef: expected a step scale in \(0, 1\].*found 2"):
        PipelineSettings(delay_compensation="step", delay_compensation_coef=2)


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
    own data, sampler, Nesterov SGD and warm-up, the default delay compensation; its metrics and
    final checkpoint are the oracle's."""
    cfg = make_cfg("pipeline.window=3", "pipeline.shared_ops=delayed", "pipeline.shared_delay=2", "sampler=fair")
    p = prepare(cfg, output_dir=tmp_path)
    run(cfg, output_dir=tmp_path, prepared=p)
    t = p.rc.train
    assert (t.checkpoint_every, t.steps) == (5, 12)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    items = [(m["step"], Arch(m["arch"]), *p.data.train_batch(m["step"], t.batch_size)) for m in metrics]
    run_ = train(p.graph, p.rc.seed, items, optim=t.optimizer,
                 lr=cosine_lr(t.optimizer.lr, t.steps, t.warmup_steps, t.lr_schedule, t.min_lr),
                 microbatches=t.microbatches, mode="delayed", delay=2, checkpoint_every=t.checkpoint_every,
                 compensation=p.rc.pipeline.delay_compensation, coef=p.rc.pipeline.delay_compensation_coef)
    assert p.rc.pipeline.delay_compensation == "predict"  # the default rule
    assert [m["loss"] for m in metrics] == run_.step_losses
    assert [m["lr"] for m in metrics] == [cosine_lr(t.optimizer.lr, t.steps, t.warmup_steps, t.lr_schedule,
                                                    t.min_lr)(k) for k in range(t.steps)]
    assert_same_states(load_checkpoint(tmp_path / "checkpoint.pt").op_states, run_.states, "app")


@pytest.mark.dist
def test_pipelined_delayed_engine_is_the_oracle() -> None:
    """P = 2 gloo ranks, several subnets in flight, ops migrating: the oracle's bits too."""
    scs = [scenario("conv", "delayed", delay=2, every=4, steps=10, sampler="fair", window=4, segment=4),
           scenario("transformer", "delayed", delay=1, every=3, steps=7, optimizer="adamw", window=3),
           # predict: the version before the one read travels with a migrating op too
           scenario("conv", "delayed", delay=2, every=5, steps=10, sampler="fair", window=4, segment=5,
                    compensation=("predict", 1.0)),
           # pipeline.shared_delays: the head (last stage) one update late, the stem three
           scenario("conv", "delayed", delay=3, every=5, steps=10, sampler="fair", window=4, segment=5,
                    delays={"head": 1})]
    results, _, _ = spawn(2, scs, timeout_s=300)
    for sc, got in zip(scs, results):
        run_ = oracle(sc)
        label = f"P=2 {sc.space} D={sc.extra['shared_delay']} {compensation_of(sc)}"
        assert got["mb_losses"] == [list(mb) for mb in run_.losses], f"{label}: micro-batch losses differ"
        assert got["losses"] == run_.step_losses, f"{label}: step losses differ"
        assert got["digest"] == params_digest(run_.states), f"{label}: final weights differ"
        assert got["overlapped"] > 0, f"{label}: no subnet began before the one before ended"
