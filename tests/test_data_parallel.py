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
        migrated += got["migrated"]
    if stages > 1:
        assert migrated > 0, f"no op migrated at (S, R)=({stages}, {replicas}): the test would not cover migration"


def test_a_failing_replica_stops_every_rank_naming_rank_replica_stage_step_action() -> None:
    sc = [Scenario("transformer", "1f1b", steps=4, extra={"stages": 2})]
    _, procs, seconds = spawn(4, sc, timeout_s=150, env_extra={"PIPENAS_FAULT": "3:2:1U:raise"}, expect_ok=False)
    assert all(p is not None for p in procs), "a rank hung"
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "rank 3 (replica 1, stage 1) failed at step 2 during 1U" in procs[3].stderr, procs[3].stderr[-2000:]
    for r in (0, 1, 2):
        assert "root cause: rank 3 failed at step 2 during 1U" in procs[r].stderr, procs[r].stderr[-2000:]
    assert seconds < 120
