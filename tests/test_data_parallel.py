"""Replicated stages (pipeline x data parallel) compute exactly what one process computes.

(S, R) in {(1, 2), (2, 2), (3, 1)}: R replicas of an S-stage pipeline, each on its share of the
step's micro-batches, gradients and batch-norm statistics folded across replicas in micro-batch
order (pipeline/replicas.py). Per-step and per-micro-batch losses, evaluations and the final
params_digest equal the single-process reference on the conv (batch norm) and transformer
(dropout) spaces, ops migrating; at (2, 2) also with several subnets in flight (window 3).
One spawn per world size, several scenarios each.
"""
from __future__ import annotations

import dataclasses

import pytest

from distributed import Scenario, assert_same_as_reference, one_process, spawn

pytestmark = pytest.mark.dist

MIGRATING = {"eps": 0.0, "objective": "minmax"}  # follow every change of the optimum


def scenarios(stages: int, cross: bool = False, fast: bool = False) -> list[Scenario]:
    extra = {**MIGRATING, "stages": stages}
    out = [Scenario("conv", "1f1b", steps=4, extra=extra, eval_archs=1),
           Scenario("transformer", "gpipe", steps=4, optimizer="adamw", extra=extra, eval_archs=1)]
    if cross:
        out.append(Scenario("transformer", "1f1b", steps=6, segment=6, extra={**extra, "window": 3}))
        out.append(Scenario("conv", "1f1b", steps=6, segment=3, extra={**extra, "window": 3}))
    if fast:  # pipeline.reduce=fast: one all-reduce, close to the reference but not bit-identical
        out.append(Scenario("conv", "1f1b", steps=4, extra={**extra, "reduce": "fast"}, eval_archs=1))
    # as the app trains flushed steps: one step per train_steps call, the sampler's next two as
    # the lookahead; every segment's agreement check is posted ahead but the first's
    out.append(Scenario("conv", "1f1b", steps=5, segment=1, extra=extra))
    return out


def reference(sc: Scenario) -> dict:
    """The single-process run of ``sc`` (without ``stages``), once per scenario."""
    extra = {k: v for k, v in sc.extra.items() if k not in ("stages", "reduce")}
    return one_process(dataclasses.replace(sc, extra=extra))


@pytest.mark.parametrize("stages,replicas", [(1, 2), (2, 2), (3, 1)])
def test_replicated_stages_are_bit_identical_to_reference(stages: int, replicas: int) -> None:
    scs = scenarios(stages, cross=(stages, replicas) == (2, 2), fast=(stages, replicas) == (1, 2))
    results, _, _ = spawn(stages * replicas, scs, timeout_s=300)
    migrated = 0
    for sc, got in zip(scs, results):
        ref = reference(sc)
        label = f"{sc.space}/{sc.schedule}/{sc.optimizer} window={sc.extra.get('window', 1)} (S, R)=({stages}, {replicas})"
        if sc.extra.get("reduce") == "fast":
            assert got["mb_losses"][0] == ref["mb_losses"][0], f"{label}: the first step (no update yet) differs"
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"{label}: fast reduction drifted"
            continue
        assert_same_as_reference(got, ref, label)
        assert len(got["mb_losses"][0]) == sc.microbatches, f"{label}: every rank sees all micro-batch losses"
        if sc.segment == 1:
            assert got["agreement_round_trips"] == 1, (
                f"{label}: {got['agreement_round_trips']} agreement checks on the critical path in {sc.steps} "
                "steps; the segments prepared ahead should carry theirs (only the first has none)")
        migrated += got["migrated"]
    if stages > 1:
        assert migrated > 0, f"no op migrated at (S, R)=({stages}, {replicas}): the test would not cover migration"



@pytest.mark.parametrize("shm", ["0", "1"])
def test_three_replicas_pass_batch_norm_statistics_and_gradients_along_the_chain(shm: str) -> None:
    """(S, R) = (1, 3): the middle replica receives both chains (batch-norm statistics on their
    own channel, sent at replica 0's last forward; the gradients' partial at the update), replays
    and adds its share, and passes both on; also with three subnets in flight, where the two
    chains' messages interleave differently. Gradients as messages and through shared memory
    (``PIPENAS_REDUCE_SHM``). Equal to one process."""
    extra = {**MIGRATING, "stages": 1}
    scs = [Scenario("conv", "1f1b", steps=4, microbatches=6, batch=18, extra=extra),
           Scenario("conv", "1f1b", steps=6, microbatches=6, batch=18, segment=3, extra={**extra, "window": 3})]
    results, _, _ = spawn(3, scs, timeout_s=300, env_extra={"PIPENAS_REDUCE_SHM": shm})
    for sc, got in zip(scs, results):
        assert_same_as_reference(got, reference(sc), f"conv window={sc.extra.get('window', 1)} (S, R)=(1, 3) shm={shm}")

def test_batch_norm_statistics_follow_each_subnet_when_last_forwards_and_updates_differ_in_order() -> None:
    """(S, R) = (2, 2), window 4, delayed shared ops, the fair sampler, the planner's defaults: at a
    fair round's boundary a subnet finishes its forwards on a stage while an earlier one waits
    there for a choice op, and updates after it (the stem's updates come in subnet order), so
    the batch-norm chain's messages (sent after each subnet's last forward) come in another
    order than the updates that take them. Before they were taken by subnet, this stopped every
    rank at step 12 ("batch-norm statistics out of order"); equal to one process now. With the
    in-flight cap in bytes too (``pipeline.inflight=bytes``)."""
    extra = {"stages": 2, "window": 4, "shared_ops": "delayed", "shared_delay": 1}
    scs = [Scenario(space, "1f1b", steps=16, segment=16, sampler="fair", extra={**extra, **more})
           for space, more in (("conv", {}), ("cell", {}), ("conv", {"inflight": "bytes"}))]
    results, _, _ = spawn(4, scs, timeout_s=300)
    for sc, got in zip(scs, results):
        assert_same_as_reference(got, reference(sc), f"{sc.space} {sc.extra} (S, R)=(2, 2)")


def test_replicas_over_the_wire_equal_one_process_too() -> None:
    """``PIPENAS_REDUCE_SHM=0``: the gradients travel through gloo as messages (as between hosts)
    instead of this host's shared memory (the other tests here); the same bits either way."""
    extra = {**MIGRATING, "stages": 1}
    scs = [Scenario("conv", "1f1b", steps=4, extra=extra),
           Scenario("transformer", "gpipe", steps=4, optimizer="adamw", extra=extra)]
    results, _, _ = spawn(2, scs, timeout_s=300, env_extra={"PIPENAS_REDUCE_SHM": "0"})
    for sc, got in zip(scs, results):
        assert_same_as_reference(got, reference(sc), f"{sc.space} over the wire (S, R)=(1, 2)")


def test_the_shared_buffers_grow_alternate_and_leave_no_name_behind() -> None:
    """Replica 0's side of the shared-memory reduction: a set per parity of the reduction's
    count (gradients per dtype and the message bytes), a new (larger) file when a subnet needs
    more, every name removed at the end of the reduction that made it (the mappings stay usable)."""
    import os

    import torch
    from torch import nn

    from pipeline.shm import SharedReduction

    shm = SharedReduction(os.urandom(8).hex(), 0, replica=0, replicas=1)
    small = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    large = small + [nn.Parameter(torch.zeros(100))]
    names = lambda: sorted(f for f in os.listdir("/dev/shm") if shm.token in f)  # noqa: E731
    a, ma = shm.begin(small, 16)
    assert {dt: t.numel() for dt, t in a.items()} == {torch.float32: 3, torch.float64: 2} and ma.numel() == 16
    assert len(names()) == 3
    a[torch.float32].fill_(1.0)
    shm.end()
    assert names() == [] and a[torch.float32].sum().item() == 3.0  # unlinked, still mapped
    b, _ = shm.begin(small, 16)  # the other parity: its own files
    assert b[torch.float32].data_ptr() != a[torch.float32].data_ptr() and len(names()) == 3
    shm.end()
    c, mc = shm.begin(large, 8)  # parity 0 again, too small now: a new generation (the message is big enough)
    assert c[torch.float32].numel() == 103 and c[torch.float32].data_ptr() != a[torch.float32].data_ptr()
    assert mc.data_ptr() == ma.data_ptr() and len(names()) == 1
    shm.end()
    d, _ = shm.begin(small, 16)  # parity 1: big enough, the same buffer
    assert d[torch.float32].data_ptr() == b[torch.float32].data_ptr() and names() == []
    shm.end()


def test_gradients_owned_after_a_fold_outlive_the_shared_buffers_next_use() -> None:
    """``ReplicaReducer.own`` (clipping folds a subnet at its last backward, ahead of its update):
    the sums leave the shared buffers, which a later reduction rewrites, and ``released`` after the
    update no longer drops them."""
    import os

    import torch
    from torch import nn

    from pipeline.replicas import ReplicaReducer, _split_views
    from pipeline.shm import SharedReduction

    shm = SharedReduction(os.urandom(8).hex(), 0, replica=0, replicas=1)
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    flats, _ = shm.begin(params, 16)
    for p, v in zip(params, _split_views(flats, params)):
        v.fill_(2.0)
        p.grad = v  # as the shared reduction leaves them: views of its buffers
    reducer = ReplicaReducer.__new__(ReplicaReducer)  # (own and released touch only the lent list)
    reducer._lent = list(params)
    reducer.own()
    flats[torch.float32].fill_(-1.0)  # the buffer's next use
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params)
    reducer.released()
    assert all(p.grad is not None for p in params)
    shm.end()


@pytest.mark.parametrize("sizes", [[], [1], [5, 3], [1 << 18], [1 << 17, 1 << 17, 1, 1 << 20, 7], [3] * 100])
def test_the_shared_chains_chunks_cover_the_parameters_in_order(sizes: list[int]) -> None:
    """The units of the shared chain's progress: consecutive, covering every parameter once,
    each at least ``_CHUNK`` elements but the last."""
    import torch
    from torch import nn

    from pipeline.replicas import _CHUNK, _chunks

    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    chunks = _chunks(params)
    assert [i for a, b in chunks for i in range(a, b)] == list(range(len(params)))
    assert all(sum(sizes[a:b]) >= _CHUNK for a, b in chunks[:-1])


def test_the_shared_doorbell_waits_for_its_peer_and_names_a_lost_one() -> None:
    """The replicas' counters (:class:`pipeline.shm.SharedReduction`): a wait returns once the
    peer's counter reached the value in this reduction or a later one; a peer whose process has
    gone, or that says nothing within the timeout, is a PeerError naming its rank (no hang)."""
    import os
    import subprocess
    import sys
    import time

    import torch

    from pipeline.shm import SharedReduction
    from pipeline.transport import PeerError

    bell = torch.zeros(16, dtype=torch.int64)  # one process stands in for both replicas
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    token = os.urandom(8).hex()
    a = SharedReduction(token, 0, 0, 2, pids=[os.getpid(), int(gone.stdout)], ranks=[4, 6], timeout_s=0.3, bell=bell)
    b = SharedReduction(token, 0, 1, 2, pids=[os.getpid(), os.getpid()], ranks=[4, 6], timeout_s=0.3, bell=bell)
    a.post(3)
    b.wait(0, 3)
    b.wait(0, 2)
    a.count += 1  # replica 0 went on to the next reduction: the earlier one's values count as reached
    a.post(0)
    b.wait(0, 7)
    b.count += 1
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="rank 4 failed: no answer within 0.3 s"):
        b.wait(0, 1)  # alive, silent
    assert time.monotonic() - t0 < 5
    with pytest.raises(PeerError, match="rank 6 failed: its process exited"):
        a.wait(1, 0)


def test_a_failing_replica_stops_every_rank_naming_rank_replica_stage_step_action() -> None:
    sc = [Scenario("transformer", "1f1b", steps=4, extra={"stages": 2})]
    _, procs, seconds = spawn(4, sc, timeout_s=150, env_extra={"PIPENAS_FAULT": "3:2:1U:raise"}, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "rank 3 (replica 1, stage 1) failed at step 2 during 1U" in procs[3].stderr, procs[3].stderr[-2000:]
    for r in (0, 1, 2):
        assert "root cause: rank 3 failed at step 2 during 1U" in procs[r].stderr, procs[r].stderr[-2000:]
    assert seconds < 120


def test_a_replica_killed_before_the_shared_reduction_ends_the_job_naming_it() -> None:
    """(S, R) = (1, 2) on one host: the gradients' chain runs in shared memory, where no socket
    closes when a peer dies. Replica 1 killed at its update: replica 0, polling the shared
    counter, sees the process gone and exits naming rank 1 (no hang until the timeout)."""
    sc = [Scenario("transformer", "1f1b", steps=4, extra={"stages": 1})]
    _, procs, seconds = spawn(2, sc, timeout_s=150, env_extra={"PIPENAS_FAULT": "1:2:0U:kill"}, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "reducing gradients with rank 1 failed: its process exited" in procs[0].stderr, procs[0].stderr[-2000:]
    assert seconds < 120


@pytest.mark.parametrize("case", ["flat", "a missing partial", "uneven contributions"])
def test_the_reductions_add_equals_one_add_per_parameter(case: str) -> None:
    """A replica adds its contributions to the partial sums where they lie (``_add_contribs``:
    in the received message's flat buffers on the wire, in the shared buffers on one host):
    one add per dtype and micro-batch where every parameter has a partial sum and the same
    number of contributions, else one per parameter, and a parameter without a partial sum gets
    its first contribution copied in. The same bits as the reference's ``+=`` per parameter in
    every case; the message then unpacks to the sums (its mask updated)."""
    import torch
    from torch import nn

    from pipeline.replicas import _add_contribs, _dtypes, _pack, _split_views, _unpack

    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5, dtype=torch.float64)),
              nn.Parameter(torch.zeros(2, 2))]
    partial = [torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e3 for p in params]
    if case == "a missing partial":
        partial[2] = None
    contribs = [[torch.randn(p.shape, generator=g, dtype=p.dtype) for _ in range(2)] for p in params]
    if case == "uneven contributions":
        contribs[1] = contribs[1][:1]
    expected = []
    for part, cs in zip(partial, contribs):
        acc = None if part is None else part.clone()
        for c in cs:
            acc = c.clone() if acc is None else acc.add_(c)
        expected.append(acc)
    # the shared chain: views of the shared buffers (a missing partial's slot holds stale bytes)
    views = [torch.full_like(p, float("nan")) if part is None else part.clone() for p, part in zip(params, partial)]
    has = [int(part is not None) for part in partial]
    changed = _add_contribs(views, contribs, list(has))
    assert (changed is None) == (case != "a missing partial") and (changed is None or changed == [1, 1, 1])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(views, expected))
    # the wire: replica 0's message, summed in place, as the next replica passes it on
    got = _pack(partial, params, [])
    mask, flats = got[0], got[1:]
    changed = _add_contribs(_split_views(dict(zip(_dtypes(params), flats)), params), contribs, mask.tolist())
    if changed is not None:
        mask.copy_(torch.tensor(changed, dtype=torch.uint8))
    grads, _ = _unpack(got, params, [])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(grads, expected))


@pytest.mark.parametrize("shape", [(8, 16, 8, 8), (8, 16, 8, 8, "channels_last"), (8, 16), (3, 5, 7)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_batch_norm_replay_equals_a_training_forward(shape: tuple, momentum: float | None) -> None:
    """A replica replays the running-statistics update of a recorded batch-norm input
    (``_replay_bn``, on the CPU through ``torch.batch_norm_update_stats``): the same bits as the
    training forward's own update, steps in a row, cumulative average (momentum None) too."""
    import torch
    from torch import nn

    from pipeline.replicas import _replay_bn

    last = shape[-1] == "channels_last"
    dims = shape[:-1] if last else shape
    make = {4: nn.BatchNorm2d, 3: nn.BatchNorm1d, 2: nn.BatchNorm1d}[len(dims)]
    fwd, rep = make(dims[1], momentum=momentum), make(dims[1], momentum=momentum)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(*dims, generator=g) * 3 + 1
        if last:
            x = x.contiguous(memory_format=torch.channels_last)
        fwd.train()(x)
        _replay_bn(rep, x)
        for a, b in zip(fwd.buffers(), rep.buffers()):
            assert torch.equal(a, b)
