"""The memory config group through the app: a budget that forces swaps gives the same weights
as all-resident, and metrics.jsonl / summary.json carry the tensor manager's figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from search.app import run
from search.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "space.layers=2", "space.channels=[4,8]", "space.downsample_at=[1]",
    "train.steps=8", "train.batch_size=32", "train.microbatches=2", "train.checkpoint_every=0", "train.warmup_steps=2",
    "search.population=4", "search.generations=1", "search.top_k=2", "search.bn_calib_batches=1",
    "search.calib_batch_size=32", "threads=1", "device=cpu",
]
BUDGET = 20_000  # bytes: the tiny conv supernet takes ~40 kB with SGD momentum, its largest subnet ~14 kB


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides])


def test_a_budget_that_forces_swaps_trains_the_same_weights(tmp_path: Path) -> None:
    plain = run(cfg(), output_dir=tmp_path / "plain")
    swapped = run(cfg(f"memory.device_budget_bytes={BUDGET}"), output_dir=tmp_path / "swapped")
    assert swapped["params_digest"] == plain["params_digest"]
    assert swapped["final_loss"] == plain["final_loss"] and swapped["best"] == plain["best"]
    m = swapped["memory"]
    assert m["device_budget_bytes"] == BUDGET and m["evictions"] > 0 and m["written_back_bytes"] > 0
    assert 0 < m["resident_bytes_peak"] <= BUDGET
    assert m["host_update_rate_measured"] is None  # memory.host_update_rate: auto; one process plans nothing
    assert plain["memory"]["device_budget_bytes"] is None and plain["memory"]["fetched_bytes"] == 0
    lines = [json.loads(x) for x in (tmp_path / "swapped" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for rec in lines:
        assert 0 < rec["resident_bytes_peak"] <= BUDGET
        assert 0 <= rec["hit_rate"] <= 1 and rec["stall_s"] >= 0
        assert rec["fetched_bytes"] >= 0 and rec["written_back_bytes"] >= 0
    assert sum(r["fetched_bytes"] for r in lines) > 0


@pytest.mark.parametrize("override, message", [
    ("memory.device_budget_bytes=-5", "memory.device_budget_bytes: expected a positive integer"),
    ("memory.policy=fifo", "memory.policy: expected one of ['belady', 'lru', 'on_demand'], found 'fifo'"),
    ("+memory.bogus=1", "memory.bogus: unknown field"),
    ("memory.activation_budget_bytes=0", "memory.activation_budget_bytes: expected a positive integer"),
    ("memory.activations=all", "memory.activations: expected one of ['keep', 'swap', 'recompute', 'peer', 'auto']"),
    ("memory.host_link_bandwidth=-1", "memory.host_link_bandwidth: expected a positive number"),
    ("memory.peer_link_bandwidth=0", "memory.peer_link_bandwidth: expected a positive number"),
    ("memory.device_budget_bytes=20000 pipeline.memory_budget_bytes=1e6",
     "pipeline.memory_budget_bytes / memory.device_budget_bytes: found pipeline.memory_budget_bytes 1000000.0"),
])
def test_bad_memory_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(cfg(*override.split()))
    assert message in str(e.value)


def test_an_infeasible_budget_stops_the_run_with_the_shortfall(tmp_path: Path) -> None:
    # checked before anything is written (tests/test_memory_precheck.py: the threshold is exact)
    with pytest.raises(ConfigError, match=r"memory\.device_budget_bytes: .* short by \d+ bytes"):
        run(cfg("memory.device_budget_bytes=1000"), output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_metrics_count_the_saved_activations_swapped_and_recomputed(tmp_path: Path) -> None:
    for mode, key in (("swap", "swapped_bytes"), ("recompute", "recomputed_ops"), ("keep", None)):
        run(cfg("train.steps=3", f"memory.activations={mode}"), output_dir=tmp_path / mode)
        lines = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        # (recompute swaps the ops with buffers instead: batch norm would update them twice)
        others = ["peered_bytes"] if key else ["swapped_bytes", "recomputed_ops", "peered_bytes"]
        assert len(lines) == 3 and all(r[k] == 0 for r in lines for k in others), mode
        assert key is None or all(r[key] > 0 for r in lines), (mode, [r[key] for r in lines])
