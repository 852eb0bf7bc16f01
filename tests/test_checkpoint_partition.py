"""Checkpoints hold ops by name, not by stage: saved with P stages, resumed with P' or in the reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import Scenario, run_scenario, spawn

pytestmark = pytest.mark.dist

CASES = [("conv", "sgd"), ("cell", "adamw")]


def test_resume_with_other_stage_counts_matches_uninterrupted_run(tmp_path) -> None:
    # every case in one 2-rank spawn (saves after 3 steps), then one 3-rank spawn (resumes):
    # process start-up dominates these runs
    torch.set_num_threads(1)
    fulls = [Scenario(space, "1f1b", steps=6, optimizer=optimizer, extra={"eps": 0.0, "objective": "minmax"})
             for space, optimizer in CASES]
    refs = [run_scenario(full) for full in fulls]
    ckpts = [str(tmp_path / f"ops-{space}.pt") for space, _ in CASES]

    firsts, _, _ = spawn(2, [dataclasses.replace(full, stop=3, save=ckpt) for full, ckpt in zip(fulls, ckpts)])
    rests = [dataclasses.replace(full, start=3, load=ckpt) for full, ckpt in zip(fulls, ckpts)]
    resumed_all, _, _ = spawn(3, rests)
    for case, ref, first, resumed, rest in zip(CASES, refs, firsts, resumed_all, rests):
        assert first["losses"] == ref["losses"][:3], case
        assert resumed["losses"] == ref["losses"][3:], case
        assert resumed["digest"] == ref["digest"], f"{case}: resumed with 3 stages from a 2-stage checkpoint: digest differs"
        in_reference = run_scenario(rest)
        assert in_reference["losses"] == ref["losses"][3:], case
        assert in_reference["digest"] == ref["digest"], f"{case}: resumed in the reference from a 2-stage checkpoint"
