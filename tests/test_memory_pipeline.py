"""The tensor manager in every pipeline stage: with a per-stage device budget that forces
evictions every step, a pipelined run (gloo, P = 2 and 3, both schedules, all three spaces, ops
migrating between stages, from host memory too) computes the same bits as the all-resident
single-process reference, and no stage's device tier ever holds more than its budget."""
from __future__ import annotations

import functools

import pytest
import torch

from distributed import Scenario, run_scenario, spawn
from test_memory import tight_budget

pytestmark = pytest.mark.dist

MIGRATING = {"eps": 0.0, "objective": "minmax"}


def budgeted(sc: Scenario, stages: int) -> Scenario:
    # a stage's slice fits (at most the largest subnet of the run, less with three stages),
    # the stage's share of the supernet does not
    budget = int(tight_budget(sc.space, sc.optimizer, sc.steps) * (1.0 if stages == 2 else 0.67))
    return Scenario(**{**sc.__dict__, "memory": {"device_budget_bytes": budget}})


PLAIN = [
    Scenario("transformer", "1f1b", steps=4, extra=MIGRATING),
    Scenario("conv", "gpipe", steps=4, optimizer="adamw", extra=MIGRATING),
    Scenario("cell", "1f1b", steps=4, extra=MIGRATING, eval_archs=1),
]


@functools.lru_cache(maxsize=None)
def reference(i: int) -> dict:
    torch.set_num_threads(1)
    res = run_scenario(PLAIN[i])  # all resident
    res.pop("engine")
    return res


@pytest.mark.parametrize("stages", [2, 3])
def test_budgeted_stages_compute_the_reference_bits_within_their_budget(stages: int) -> None:
    scenarios = [budgeted(sc, stages) for sc in PLAIN]
    results, _, _ = spawn(stages, scenarios, timeout_s=300)
    for i, (sc, got) in enumerate(zip(scenarios, results)):
        ref, label = reference(i), f"{sc.space}/{sc.schedule}/{sc.optimizer} P={stages}"
        assert got["losses"] == ref["losses"] and got["mb_losses"] == ref["mb_losses"], f"{label}: losses differ"
        assert got["evals"] == ref["evals"], f"{label}: evaluations differ"
        assert got["digest"] == ref["digest"], f"{label}: params_digest differs"
        budget = sc.memory["device_budget_bytes"]
        assert all(0 < p <= budget for p in got["resident_peak"]), f"{label}: {got['resident_peak']} vs {budget}"
        assert sum(got["evictions"]) > 0, f"{label}: the budget should force evictions"
        assert got["migrated"] > 0, f"{label}: ops should migrate"


SWAPPED = [
    Scenario("transformer", "1f1b", steps=3, extra=MIGRATING, memory={"activations": "swap"}),
    Scenario("conv", "gpipe", steps=3, memory={"activations": "recompute"}),  # batch norm: swapped instead
    Scenario("cell", "1f1b", steps=3, optimizer="adamw", memory={"activations": "recompute"}),
    Scenario("transformer", "gpipe", steps=3, memory={"activations": "recompute"}),  # dropout: derived randomness
]


@functools.lru_cache(maxsize=None)
def kept(i: int) -> dict:
    torch.set_num_threads(1)
    res = run_scenario(Scenario(**{**SWAPPED[i].__dict__, "memory": {}}))
    res.pop("engine")
    return res


def test_swapped_and_recomputed_activations_compute_the_same_bits_in_one_process() -> None:
    for i, sc in enumerate(SWAPPED):
        res = run_scenario(sc)
        policy = res.pop("engine").last_policy
        assert res["losses"] == kept(i)["losses"] and res["digest"] == kept(i)["digest"], sc
        assert policy.swapped_bytes > 0 or policy.recomputed_ops > 0, sc


@pytest.mark.parametrize("stages", [2, 3])
def test_swapped_and_recomputed_activations_compute_the_same_bits_in_stages(stages: int) -> None:
    results, _, _ = spawn(stages, SWAPPED, timeout_s=300)
    for i, (sc, got) in enumerate(zip(SWAPPED, results)):
        assert got["losses"] == kept(i)["losses"] and got["mb_losses"] == kept(i)["mb_losses"], sc
        assert got["digest"] == kept(i)["digest"], sc
