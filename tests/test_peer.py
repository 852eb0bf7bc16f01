"""The peer tier at run time (issue 26): a stage hands saved activations to its paired stage and
gets them back unchanged, so a pipelined run with the tier forced on computes the one-process
bits; the tier's own protocol between two gloo processes; a failing rank ends the job.

Pure planning of the tier is tested in tests/test_activations.py (against enumeration) and its
simulated figures in tests/test_bench_vtm.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from distributed import Scenario, assert_same_as_reference, one_process, spawn
from pipeline.memory import MemorySettings
from pipeline.memory.peer import peer_needed
from supernet.activations import ActivationPolicy, run_with_policy
from supernet.ops import OpContext
from tests.cli_driver import child_env
from tests.zygote import collect, launch

ROOT = Path(__file__).resolve().parents[1]
MIGRATING = {"eps": 0.0, "objective": "minmax"}


# ------------------------------------------------------------------------ one process (a stand-in peer)


class DictPeer:
    """An in-process stand-in for the paired stage: keeps what it is handed, by key."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}
        self.groups: list[object] = []

    def put(self, t: torch.Tensor, group: object = None):
        if t.dtype == torch.complex64:
            return None  # a tensor it cannot carry stays with the stage
        key = len(self.store) + 1
        self.store[key] = t.detach().clone()
        self.groups.append(group)
        return key

    def get(self, key: int) -> torch.Tensor:
        return self.store.pop(key)


class _Op(torch.nn.Module):
    """An op as the supernet calls it (``forward(*inputs, ctx)``)."""

    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, ctx: OpContext) -> torch.Tensor:
        return self.body(x)


def _two_layers(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return _Op(torch.nn.Linear(32, 64), torch.nn.GELU()), _Op(torch.nn.LayerNorm(64), torch.nn.Linear(64, 10))


def _grads(policy: ActivationPolicy | None, seed: int = 0) -> list[torch.Tensor]:
    a, b = _two_layers(seed)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    h = run_with_policy(a, [x], OpContext(0, 3, 1, "a", True), policy)
    out = run_with_policy(b, [h], OpContext(0, 3, 1, "b", True), policy)
    out.square().sum().backward()
    return [p.grad for m in (a, b) for p in m.parameters()]


def test_peer_activations_come_back_unchanged() -> None:
    keep = _grads(None)
    peer = DictPeer()
    policy = ActivationPolicy({"a": "peer", "b": "peer"}, peer=peer)
    got = _grads(policy)
    assert all(torch.equal(g, k) for g, k in zip(got, keep))
    assert policy.peered_bytes > 0 and not peer.store  # every tensor sent was fetched back
    assert set(peer.groups) == {(3, 1)}  # grouped by (step, micro-batch): fetched together
    # without a pair (one process, a holding stage) ``peer`` keeps
    alone = ActivationPolicy({"a": "peer", "b": "peer"})
    assert torch.equal(_grads(alone)[0], keep[0]) and alone.peered_bytes == 0


def test_the_mode_and_the_link_are_settings() -> None:
    assert MemorySettings(activations="peer").peer_link_bandwidth == 150e9
    with pytest.raises(ValueError, match="memory.peer_link_bandwidth: expected a positive number"):
        MemorySettings(peer_link_bandwidth=0)
    peer, auto = MemorySettings(activations="peer"), MemorySettings(activations="auto", activation_budget_bytes=10**6)
    assert peer_needed(peer, 2, 2) and peer_needed(auto, 4, 4)
    assert not peer_needed(MemorySettings(activations="auto"), 4, 4)  # no budget: every activation kept
    assert not peer_needed(peer, 1, 1) and not peer_needed(MemorySettings(activations="swap"), 4, 4)
    assert not peer_needed(peer, 2, 1) and not peer_needed(None, 4, 4)


def test_forced_peer_gives_every_op_of_the_earlier_stages() -> None:
    from pipeline.memory.sizing import MemoryModel
    from pipeline.plan.partition import OpCost, PartitionProblem

    ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, 0, 0, 4000) for k in range(5))
    problem = PartitionProblem(ops, tuple([1000] * 6), 5, 8, "1f1b")
    choices = MemoryModel(MemorySettings(activations="peer")).activation_choices(problem, (0, 1, 2, 3, 4, 5))
    assert [set(c.values()) for c in choices] == [{"peer"}, {"peer"}, {"keep"}, {"keep"}, {"keep"}]


def test_auto_peers_where_the_pair_has_room() -> None:
    """``auto`` with a budget: the holder plans first, its room left is the giver's."""
    from pipeline.memory.sizing import MemoryModel
    from pipeline.plan.partition import OpCost, PartitionProblem

    ops = tuple(OpCost(f"op{k}", 1e-3, 2e-3, 0, 0, 4000) for k in range(4))
    problem = PartitionProblem(ops, tuple([1000] * 5), 2, 8, "1f1b")  # stage 0 holds 2 micro-batches, stage 1 one
    budget = 2 * (2 * 4000) + 2 * 1000 - 4000  # stage 0 keeps all but 4000 B
    model = MemoryModel(MemorySettings(activations="auto", activation_budget_bytes=budget, host_link_bandwidth=1e3))
    # F = 2: a peered op's giver keeps 2 micro-batches, no saving; nothing to gain
    assert "peer" not in model.activation_choices(problem, (0, 2, 4))[0].values()
    problem4 = PartitionProblem(ops, tuple([1000] * 5), 4, 8, "1f1b")  # stage 0 holds 4, stage 3 one
    budget4 = 4 * 4000 + 4 * 1000 - 1  # stage 0 (one op) 1 byte short; stage 3 has 14999 B of room for 12000
    model4 = MemoryModel(MemorySettings(activations="auto", activation_budget_bytes=budget4, host_link_bandwidth=1e3))
    c = model4.activation_choices(problem4, (0, 1, 2, 3, 4))
    assert c[0] == {"op0": "peer"} and set(c[3].values()) == {"keep"}


# ------------------------------------------------------------------------ the protocol, two gloo processes


def _protocol_worker(rendezvous: str, rank: int, mode: str) -> None:
    """Rank 0 gives, rank 1 holds. ``mode``: ``ok`` (puts, gets, drops, close), ``holder-dies``
    (rank 1 exits while rank 0 waits for a get), ``giver-dies`` (rank 0 exits; rank 1's thread ends)."""
    import datetime
    import gc

    import torch.distributed as dist

    from pipeline.memory.peer import open_peer
    from pipeline.transport import PeerError

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    tier = open_peer(rank, 2, lambda s: s, torch.device("cpu"), timeout_s=20.0)
    out: dict = {}
    if rank == 0:
        c = tier.client
        g = torch.Generator().manual_seed(0)
        sent = [torch.randn(3, 5, generator=g), torch.randint(0, 9, (7,), generator=g),
                torch.randn(2, 3, 4, generator=g).to(torch.bfloat16), torch.randn(4, 4, generator=g).t()]
        handles = [c.put(t, group="mb0") for t in sent]
        c.put(torch.ones(9), group="mb1")  # its handle dies at once: the holder is told to drop it
        assert c.put(torch.zeros(2, dtype=torch.complex64)) is None  # not carried: the caller keeps it
        gc.collect()
        out["before_get"] = c.sent_bytes  # all of it held by the pair at once
        back = [c.get(h) for h in reversed(handles)][::-1]  # the first get asks for the whole micro-batch
        out["equal"] = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(sent, back))
        out["again"] = torch.equal(c.get(handles[0]), sent[0])  # a second unpack: the same tensor
        # a micro-batch's tensor asked for with its sibling and never unpacked: its receive is
        # waited for before the next request, and nothing is left behind on either side
        pair = [c.put(torch.full((6,), 2.0), group="mb3"), c.put(torch.full((3,), 5.0), group="mb3")]
        out["first"] = torch.equal(c.get(pair[0]), torch.full((6,), 2.0))
        pair.clear()  # the second, asked for with the first, dies unpacked
        gc.collect()
        last = c.put(torch.arange(4.0), group="mb4")
        out["last"] = torch.equal(c.get(last), torch.arange(4.0)) and not c._orphans
        # asked for ahead (the executor, one action before the backward): in flight before the unpack
        ahead = [c.put(torch.full((5,), 7.0), group="mb5"), c.put(torch.full((2,), 8.0), group="mb5")]
        c.prefetch("mb5")
        c.prefetch("mb5")  # nothing left to ask
        out["ahead"] = all(h._recv is not None for h in ahead) and [c.get(h).tolist() for h in ahead] == [
            [7.0] * 5, [8.0] * 2]
        if mode == "holder-dies":
            h = c.put(torch.ones(5), group="mb2")
            dist.barrier()  # rank 1 exits after this: ask only once it is gone (else it may still answer)
            stat = Path(f"/proc/{int((Path(rendezvous).parent / 'holder.pid').read_text())}/stat")
            while True:  # gone, or a zombie its parent has not reaped yet
                try:
                    if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                        break
                except FileNotFoundError:
                    break
                time.sleep(0.01)
            try:
                c.get(h)
                out["error"] = None
            except PeerError as e:
                out["error"] = str(e)
            print(json.dumps(out), flush=True)
            os._exit(0)
        if mode == "giver-dies":
            dist.barrier()
            os._exit(3)
        out["sent"], out["fetched"] = c.sent_bytes, c.fetched_bytes
        tier.close()
    else:
        if mode == "holder-dies":
            (Path(rendezvous).parent / "holder.pid").write_text(str(os.getpid()))
            dist.barrier()
            os._exit(0)
        if mode == "giver-dies":
            dist.barrier()
            tier.server._thread.join(20)
            out["alive"] = tier.server._thread.is_alive()
            out["error"] = type(tier.server.error).__name__
            print(json.dumps(out), flush=True)
            os._exit(0)
        tier.close()
        out["held_after"], out["peak"] = tier.server.held_bytes, tier.server.peak_bytes
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _protocol(mode: str) -> list[subprocess.CompletedProcess]:
    tmp = Path(tempfile.mkdtemp(prefix="pipenas-peer-"))
    env = child_env(OMP_NUM_THREADS="1")
    procs = [launch([__file__, str(tmp / "rdzv"), str(r), mode], env, ROOT) for r in range(2)]
    done = collect(procs, 120)
    if None in done:
        raise AssertionError(f"peer tier protocol ({mode}): a rank hung")
    return done


@pytest.mark.dist
def test_the_protocol_puts_gets_drops_and_closes() -> None:
    giver, holder = _protocol("ok")
    assert giver.returncode == 0 and holder.returncode == 0, giver.stderr[-3000:] + holder.stderr[-3000:]
    g, h = json.loads(giver.stdout.splitlines()[-1]), json.loads(holder.stdout.splitlines()[-1])
    assert g["equal"] and g["again"] and g["first"] and g["last"] and g["ahead"]
    assert g["sent"] == g["fetched"] + 9 * 4 + 3 * 4  # everything came back but the dropped and the orphan
    assert h["held_after"] == 0 and h["peak"] == g["before_get"]  # the holder forgot the dropped one too


@pytest.mark.dist
def test_a_lost_pair_is_an_error_not_a_hang() -> None:
    giver, holder = _protocol("holder-dies")
    assert holder.returncode == 0
    g = json.loads(giver.stdout.splitlines()[-1])
    assert g["equal"] and g["error"] and "rank 1" in g["error"], giver.stderr[-3000:]
    giver, holder = _protocol("giver-dies")
    assert giver.returncode == 3
    h = json.loads(holder.stdout.splitlines()[-1])
    assert h["alive"] is False and h["error"] == "PeerError", holder.stderr[-3000:]


# ------------------------------------------------------------------------ pipelines: the one-process bits


def peer_scenarios() -> list[Scenario]:
    peer = {"activations": "peer"}
    return [
        Scenario("transformer", "1f1b", steps=3, extra=MIGRATING, memory=peer),  # dropout: derived randomness
        Scenario("conv", "gpipe", steps=3, memory=peer, eval_archs=1),  # batch norm
        # several subnets in flight, a tensor-manager budget beside the tier
        Scenario("transformer", "1f1b", steps=4, segment=4, sampler="fair", memory=peer,
                 extra={**MIGRATING, "window": 3, "shared_ops": "delayed"}),
        Scenario("cell", "1f1b", steps=3, optimizer="adamw", memory=peer),
    ]


def budgeted_and_replicated() -> list[Scenario]:
    """At world 4: the tier beside a tensor-manager budget that evicts every step (the default
    hybrid placement), and on the (2 stages x 2 replicas) mesh (each replica's stage 0 gives to
    its own stage 1)."""
    from test_composition import budgeted

    peer = {"activations": "peer"}
    return [
        Scenario("conv", "1f1b", steps=4, segment=4, optimizer="adamw", sampler="fair",
                 memory={**peer, **budgeted("conv", "adamw", "fair")}, extra={**MIGRATING, "window": 2}),
        Scenario("transformer", "1f1b", steps=3, memory=peer, extra={**MIGRATING, "stages": 2}),
    ]


def auto_scenarios(stages: int) -> list[Scenario]:
    """``memory.activations=auto`` at 1.2x the least activation budget its plans meet: the plans
    hand some ops' activations to the pair (checked on the plans, which are pure)."""
    from test_memory_pipeline import least_feasible, planned

    out = []
    for sc in (Scenario("transformer", "1f1b", steps=3, extra=MIGRATING), Scenario("cell", "1f1b", steps=3)):
        least = least_feasible(sc, stages, "activation_budget_bytes", 1 << 24, rel=1 / 64, activations="auto")
        memory = {"activations": "auto", "activation_budget_bytes": int(1.2 * least)}
        plans = planned(sc, stages, memory)
        assert any(c == "peer" for p in plans for st in p.activations for c in st.values()), sc
        out.append(dataclasses.replace(sc, memory=memory))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_forced_peer_computes_the_one_process_bits(world: int) -> None:
    """Forced on (every op of the earlier half's stages), and at P = 4 planned by ``auto``."""
    forced = peer_scenarios() + (budgeted_and_replicated() if world == 4 else [])
    scs = forced + (auto_scenarios(world) if world == 4 else [])
    results, _, _ = spawn(world, scs, timeout_s=600)
    for sc, got in zip(scs, results):
        label = f"{sc.space}/{sc.schedule} window={sc.extra.get('window', 1)} P={world} {sc.memory}"
        alone = {k: v for k, v in sc.extra.items() if k != "stages"}  # one process: no layout
        ref = one_process(dataclasses.replace(sc, memory={}, extra=alone))
        assert_same_as_reference(got, ref, label)
        stages = sc.extra.get("stages", world)
        gives = [r % stages < stages // 2 for r in range(world)]  # stage s < P - 1 - s of each replica
        assert not any(b for b, g in zip(got["peered"], gives) if not g), f"{label}: {got['peered']}"
        assert not any(b for b, g in zip(got["peer_held"], gives) if g), f"{label}: {got['peer_held']}"
        if sc in forced:
            assert all(b > 0 for b, g in zip(got["peered"], gives) if g), f"{label}: {got['peered']}"
            assert all(b > 0 for b, g in zip(got["peer_held"], gives) if not g), f"{label}: {got['peer_held']}"
        else:
            assert sum(got["peered"]) > 0 and sum(got["peer_held"]) > 0, f"{label}: {got['peered']}"
        budget = sc.memory.get("device_budget_bytes")
        if budget:
            assert sum(got["evictions"]) > 0 and all(0 < p <= budget for p in got["resident_peak"]), label


@pytest.mark.dist
def test_torchrun_with_the_peer_tier_forced_on_equals_one_process(tmp_path: Path) -> None:
    """The README's command: ``torchrun ... -m search memory.activations=peer`` at P = 2 ends with
    the one-process run's params_digest (where ``peer`` keeps: no pair)."""
    from tests.cli_driver import Case, run_cases, torchrun_search
    from tests.test_app import TINY_CONV

    args = [*TINY_CONV, "train.steps=4", "train.batch_size=16", "train.microbatches=4", "train.warmup_steps=0",
            "train.log_every=2", "search.population=2", "search.generations=1", "search.top_k=1",
            "search.bn_calib_batches=1", "search.calib_batch_size=8", "search.val_batch_size=8", "threads=1",
            "memory.activations=peer", "memory.peer_link_bandwidth=150e9"]
    (one,) = run_cases([Case([*args, "hydra.run.dir=runs/one"], str(tmp_path))])
    assert one.status == 0, one.stderr[-3000:]
    p = torchrun_search([*args, "pipeline.stages=2", "hydra.run.dir=runs/two"], tmp_path, timeout_s=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    digest = lambda d: json.loads((tmp_path / "runs" / d / "summary.json").read_text())["params_digest"]  # noqa: E731
    assert digest("two") == digest("one")
    metrics = lambda d: [json.loads(x) for x in (tmp_path / "runs" / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    # metrics.jsonl says what rank 0 handed its pair each step (nothing in one process: no pair)
    assert all(m["peered_bytes"] > 0 for m in metrics("two")) and all(m["peered_bytes"] == 0 for m in metrics("one"))


@pytest.mark.dist
def test_a_failing_rank_ends_a_run_with_the_peer_tier() -> None:
    """A holder raising mid-step, and a giver killed mid-step: every rank exits, none hangs."""
    sc = [Scenario("transformer", "1f1b", steps=4, memory={"activations": "peer"})]
    for fault, failed in (("1:2:1B1:raise", 1), ("0:2:0B2:kill", 0)):
        _, procs, _ = spawn(2, sc, timeout_s=150, env_extra={"PIPENAS_FAULT": fault}, expect_ok=False)
        assert all(p is not None for p in procs), f"{fault}: a rank hung"
        assert all(p.returncode != 0 for p in procs), (fault, [p.returncode for p in procs])
        if fault.endswith("raise"):
            assert "rank 1 (stage 1) failed at step 2 during 1B1" in procs[failed].stderr, procs[failed].stderr[-2000:]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _protocol_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
