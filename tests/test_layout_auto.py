"""``pipeline.stages=auto`` / ``window=auto`` on real gloo ranks: every rank measures alike (the op
profile, the runtime costs of pipeline/calibrate.py, cached), picks the same layout, and the run
computes what one process computes, bit for bit. One spawn, several scenarios (the second
engine reads the caches the first wrote)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from distributed import Scenario, assert_same_as_reference, one_process, spawn

pytestmark = pytest.mark.dist

AUTO = {"stages": "auto", "window": "auto"}


def test_auto_layout_measures_once_picks_alike_and_matches_one_process(tmp_path: Path) -> None:
    scs = [Scenario("conv", "1f1b", steps=4, extra=dict(AUTO), eval_archs=1),
           Scenario("conv", "1f1b", steps=6, segment=3, sampler="fair",
                    extra={**AUTO, "shared_ops": "delayed"})]
    cache = tmp_path / "cache"
    results, _, _ = spawn(2, scs, timeout_s=300, env_extra={"PIPENAS_CACHE": str(cache)})
    for sc, got in zip(scs, results):
        ref = one_process(dataclasses.replace(sc, extra={k: v for k, v in sc.extra.items() if k not in AUTO}))
        assert_same_as_reference(got, ref, f"{sc.space} {sc.extra}")
        assert len(got["mb_losses"][0]) == sc.microbatches
    runtime = [json.loads(p.read_text()) for p in cache.glob("runtime-*.json")]
    assert len(runtime) == 1 and runtime[0]["fields"]["world_size"] == 2  # measured once, then read back
    assert runtime[0]["costs"]["source"] == "measured" and runtime[0]["costs"]["bandwidth"] > 0
    assert list(cache.glob("profile-*.json")), "the op profile the layout was priced with is cached too"
