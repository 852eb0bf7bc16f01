"""The tensor-manager benchmark's accounting on NASPipe's space (simulated: no clocks asserted)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vtm import build_space, hide_threshold, run_setting  # noqa: E402


@pytest.fixture(scope="module")
def space():
    return build_space(30, 0, 2e14, 2e12, 1e-5)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_policies_against_all_resident(space, placement: str) -> None:
    r = run_setting(space, 4, 8, 4.0, placement, 25e9, 1.5e9)
    base = r["all_resident"]["subnets_per_hour"]
    for policy in ("on_demand", "lru", "belady"):
        p = r[policy]
        assert p["subnets_per_hour"] <= base * (1 + 1e-9)  # infinite memory is never slower
        assert p["hit_rate"] + p["prefetched_share"] + p["miss_share"] == pytest.approx(1.0)
        assert p["peak_resident_GB"] * 1e9 <= max(st["resident"] for st in r["stage_memory_GB"]) * 1e9 + 1e6
    # prefetching from the known future never loses to fetching on demand
    assert r["belady"]["subnets_per_hour"] >= r["on_demand"]["subnets_per_hour"]
    assert r["on_demand"]["prefetched_share"] == 0.0
    if placement == "device":
        # Belady keeps more of what comes back, so it moves fewer bytes than LRU
        assert r["belady"]["hit_rate"] >= r["lru"]["hit_rate"]
        assert r["belady"]["MB_moved_per_subnet"]["h2d"] <= r["lru"]["MB_moved_per_subnet"]["h2d"]
    else:
        # a device copy is stale once the host has updated it: every use fetches the weights
        assert r["belady"]["hit_rate"] == 0.0
    # the memory split never exceeds the stage budget
    for st in r["stage_memory_GB"]:
        assert st["grads"] + st["acts"] + st["resident"] <= r["budget_per_stage_GB"] + 1e-3


def test_hide_threshold_reads_the_sweep(space) -> None:
    rows = [dict(P=4, oversubscription=4.0, placement="device", host_link_GBps=25.0, tokens_per_step=1024 * M,
                 **run_setting(space, 4, M, 4.0, "device", 25e9, 1.5e9, ("belady",))) for M in (1, 8)]
    (th,) = hide_threshold(rows, share=0.05)
    assert [p["tokens_per_step"] for p in th["sweep"]] == [1024, 8192]
    assert th["hidden_from_tokens_per_step"] in (1024, 8192, None)
    if th["sweep"][0]["stall_share"] > 0.05:
        assert th["hidden_from_tokens_per_step"] != 1024


@pytest.mark.parametrize("oversub", [4.0, 8.0])
def test_hybrid_is_at_least_the_better_placement(space, oversub: float) -> None:
    r = {pl: run_setting(space, 4, 8, oversub, pl, 25e9, 1.5e9, ("belady",)) for pl in ("device", "host", "hybrid")}
    hyb = r["hybrid"]["belady"]
    assert hyb["subnets_per_hour"] >= max(r[pl]["belady"]["subnets_per_hour"] for pl in ("device", "host"))
    assert hyb["subnets_per_hour"] <= r["hybrid"]["all_resident"]["subnets_per_hour"] * (1 + 1e-9)
    # ops the next subnet reuses stay on the device (hits); the rest are updated on the host
    assert hyb["hit_rate"] > 0 and 0 < r["hybrid"]["hybrid"]["host_share"] < 1
    assert hyb["hit_rate"] + hyb["prefetched_share"] + hyb["miss_share"] == pytest.approx(1.0)
    assert hyb["peak_resident_GB"] * 1e9 <= max(st["resident"] for st in r["hybrid"]["stage_memory_GB"]) * 1e9 + 1e6


@pytest.mark.parametrize("placement", ["host", "hybrid"])
def test_the_memory_ceiling_bounds_every_policy(space, placement: str) -> None:
    """Copies free and only the step's weights held: no placement or policy does better."""
    r = run_setting(space, 8, 8, 8.0, placement, 25e9, 1.5e9, ("on_demand", "belady"), ceiling=True)
    ceiling = r["ceiling"]["subnets_per_hour"]
    assert ceiling <= r["all_resident"]["subnets_per_hour"] * (1 + 1e-9)
    for policy in ("on_demand", "belady"):
        assert r[policy]["subnets_per_hour"] <= ceiling * (1 + 1e-9)


def test_the_app_samplers_and_orders_train_the_same_subnets_per_round(space) -> None:
    """bench/vtm.py takes its subnets from the app's samplers: uniform as drawn is the stream it
    always simulated; the locality order permutes each fair round (the same subnets)."""
    rng = random.Random(0)  # what the bench drew before it asked the app's sampler
    assert space.archs == tuple(space.graph.space().random(rng) for _ in range(30))
    fair = build_space(48, 0, 2e14, 2e12, 1e-5, "fair", "stream", space.graph, space.table)
    local = build_space(48, 0, 2e14, 2e12, 1e-5, "fair", "locality", space.graph, space.table)
    for k in (0, 24):  # NASPipe's rounds: 24 candidates per layer
        assert sorted(map(repr, fair.archs[k:k + 24])) == sorted(map(repr, local.archs[k:k + 24]))
    assert fair.archs != local.archs


def test_a_smaller_arena_quantile_gives_the_activations_more_memory(space) -> None:
    full = run_setting(space, 4, 16, 8.0, "hybrid", 25e9, 1.5e9, ("belady",))
    assert run_setting(space, 4, 16, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), arena_quantile=1.0) == full
    half = run_setting(space, 4, 16, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), arena_quantile=0.5)
    for a, b in zip(full["stage_memory_GB"], half["stage_memory_GB"]):
        assert b["acts"] >= a["acts"] and b["resident"] <= a["resident"]
    assert half["belady"]["peak_resident_GB"] <= max(st["resident"] for st in half["stage_memory_GB"]) + 1e-3
    assert half["hybrid"]["host_share"] >= full["hybrid"]["host_share"]  # state sent home where a step is over
    with pytest.raises(ValueError, match="arena_quantile"):
        run_setting(space, 4, 16, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), arena_quantile=0.0)


def test_the_peer_tier_hands_activations_to_the_paired_stage(space) -> None:
    """Issue 26: with the peer tier the holders (stages P - 1 - s of the later half) keep what their
    givers hand them within what they lend; the ceiling never falls; the profile adds up. (8x: at
    4x every stage keeps its activations.)"""
    P = 8
    base = run_setting(space, P, 8, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), ceiling=True)
    peer = run_setting(space, P, 8, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), ceiling=True, peer_link=150e9)
    assert base["activations"]["peered_share"] == 0.0 and peer["activations"]["peered_share"] > 0
    assert peer["ceiling"]["over_all_resident"] >= base["ceiling"]["over_all_resident"] - 1e-12
    prof = peer["activation_profile_GB"]
    for s in range(P):
        st = peer["stage_memory_GB"][s]
        assert prof["device"][s] == pytest.approx(prof["own"][s] + prof["held_for_pair"][s], abs=2e-3)
        assert prof["device_max"][s] <= st["acts"] + st["lend"] + 1e-3  # within its share and what it lends
        if s < P // 2:
            assert prof["held_for_pair"][s] == 0.0 and st["lend"] == 0.0  # givers hold nothing for anyone
        assert st["grads"] + st["acts"] + st["resident"] + st["lend"] <= peer["budget_per_stage_GB"] + 1e-3
    assert prof["held_for_pair"][P - 1] > 0
    assert base["activation_profile_GB"]["held_for_pair"] == [0.0] * P
    assert peer["belady"]["MB_moved_per_subnet"]["peer_out"] > 0
    assert "peer_out" not in base["belady"]["MB_moved_per_subnet"]
    # lending nothing still uses what a holder's own activations leave, and never costs the baseline's keep
    none = run_setting(space, P, 8, 8.0, "hybrid", 25e9, 1.5e9, ("belady",), peer_link=150e9, peer_lend=0.0)
    assert [st["resident"] for st in none["stage_memory_GB"]] == [st["resident"] for st in base["stage_memory_GB"]]
