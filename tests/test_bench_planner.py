"""The NASPipe planner benchmark's accounting (simulated, deterministic: no clocks asserted)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.naspipe_planner import run_setting  # noqa: E402
from pipeline.plan.costs import analytic_costs  # noqa: E402
from supernet.spaces import transformer  # noqa: E402


@pytest.fixture(scope="module")
def result() -> dict:
    graph = transformer.build(input_shape=(16, 32), num_classes=10, preset="naspipe", layers=8, width=64)
    table = analytic_costs(graph, (16, 32), 4, "sgd", flops_per_s=1e12, bytes_per_s=1e11, overhead_s=1e-5)
    archs = [graph.space().random(rng) for rng in [random.Random(0)] for _ in range(40)]
    return run_setting(graph, table, archs, 4, 8, dict(latency_s=1e-5, bandwidth=1e9), 0.05)


def test_moves_made_during_the_step_before_never_cost_more_than_moves_that_wait(result: dict) -> None:
    for name in ("dynamic", "static", "oracle", "dynamic_minmax"):
        r = result[name]
        assert r["subnets_per_hour"] >= r["subnets_per_hour_all_moves_wait"] * (1 - 1e-12)
        assert r["subnets_per_hour_no_migration"] >= r["subnets_per_hour"] * (1 - 1e-12)
        assert r["migrated_bytes_per_subnet_on_critical_path"] <= r["migrated_bytes_per_subnet"]
    assert result["oracle"]["subnets_per_hour"] == result["oracle"]["subnets_per_hour_no_migration"]


def test_the_planner_told_nothing_of_the_step_before_is_charged_every_move(result: dict) -> None:
    r = result["dynamic_all_wait"]
    assert r["subnets_per_hour"] == r["subnets_per_hour_all_moves_wait"]
    assert r["migrated_bytes_per_subnet_on_critical_path"] == r["migrated_bytes_per_subnet"]


def test_the_oracle_balances_every_subnet_best(result: dict) -> None:
    assert result["oracle"]["mean_slowest_stage_ms"] <= result["static"]["mean_slowest_stage_ms"]
    assert result["oracle"]["mean_slowest_stage_ms"] <= result["dynamic"]["mean_slowest_stage_ms"] * (1 + 1e-9)
