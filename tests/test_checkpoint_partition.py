"""Checkpoints hold ops by name, not by stage: saved with P stages, resumed with P' or in the reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import Scenario, run_scenario, spawn

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("space,optimizer", [("conv", "sgd"), ("cell", "adamw")])
def test_resume_with_other_stage_counts_matches_uninterrupted_run(tmp_path, space: str, optimizer: str) -> None:
    torch.set_num_threads(1)
    full = Scenario(space, "1f1b", steps=6, optimizer=optimizer, extra={"eps": 0.0, "objective": "minmax"})
    ref = run_scenario(full)
    ckpt = str(tmp_path / "ops.pt")

    (first,), _, _ = spawn(2, [dataclasses.replace(full, stop=3, save=ckpt)])
    assert first["losses"] == ref["losses"][:3]

    rest = dataclasses.replace(full, start=3, load=ckpt)
    (resumed,), _, _ = spawn(3, [rest])
    assert resumed["losses"] == ref["losses"][3:]
    assert resumed["digest"] == ref["digest"], "resumed with 3 stages from a 2-stage checkpoint: digest differs"

    in_reference = run_scenario(rest)
    assert in_reference["losses"] == ref["losses"][3:]
    assert in_reference["digest"] == ref["digest"], "resumed in the reference from a 2-stage checkpoint: digest differs"
