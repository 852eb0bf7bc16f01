"""The cross-subnet tensor-manager benchmark's accounting on a small space (simulated: no clocks asserted)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cross_subnet import build_space  # noqa: E402
from bench.vtm_cross import (  # noqa: E402
    RUNTIME_VARIANTS, WHAT_IFS, Stream, baseline, depth_of, memory_split, run_setting, verdicts,
)
from search.samplers import make_sampler  # noqa: E402

SMALL = dict(layers=8, width=64, microbatch=4, sample_shape=(16, 32),
             rates=dict(flops_per_s=1e12, bytes_per_s=1e11, overhead_s=1e-5), link=dict(latency_s=1e-5, bandwidth=1e9))
VARIANTS = RUNTIME_VARIANTS + WHAT_IFS


@pytest.fixture(scope="module", params=["sgd", "adamw"])
def stream(request) -> Stream:
    space = build_space(**SMALL, optimizer=request.param)
    s = make_sampler("fair", space.graph.space(), 0)
    return Stream(space, [s.next() for _ in range(16)], 2, 2)


def test_with_room_for_everything_and_free_copies_it_is_the_all_resident_run(stream: Stream) -> None:
    # over-subscription far below 1: every activation kept, every op fits; an infinitely fast link
    res = run_setting(stream, 2, 1e-3, math.inf, [2.0], VARIANTS)
    assert res["recomputed_share"] == res["swapped_share"] == 0.0
    assert res["acts_only_over_all_resident"] == res["bound_no_copies_over_all_resident"] == 1.0
    for v, r in res["rows"].items():
        assert r["over_all_resident"] == 1.0, v
        assert r["stalls"]["count"] == 0 and r["stalls"]["seconds_all_stages"] == 0.0


@pytest.mark.parametrize("oversub", [4.0, 8.0])
def test_a_budget_is_split_and_kept(stream: Stream, oversub: float) -> None:
    window = 2
    res = run_setting(stream, window, oversub, 25e9 / 1e4, [2.0, 3.0], VARIANTS)  # a slow link: copies show
    assert not res.get("infeasible")
    budget = res["budget_per_stage_GB"]
    ops = stream.space.table.ops
    per_param = 16 if stream.space.optimizer == "adamw" else 12  # weights, grads and optimizer state
    assert budget * 1e9 == pytest.approx(sum(c.param_bytes for c in ops.values()) * per_param / 4 / (oversub * 2))
    for s in range(2):
        total = res["arena_GB"][s] + res["activations_GB"][s] + res["grads_reserve_GB"][s]
        assert total <= budget + 2e-3  # rounded to MB
        assert res["arena_GB"][s] + 1e-3 >= res["largest_subnet_state_GB"][s]  # a lone subnet fits
    assert set(res["arena_tried"]) == {"2.0", "3.0"} and res["arena_subnets"] in (2.0, 3.0)
    assert max(res["subnets_in_flight_max"]) <= window
    assert res["bound_no_copies_over_all_resident"] <= res["acts_only_over_all_resident"] + 1e-9 <= 1 + 2e-9
    for v, r in res["rows"].items():
        assert 0 < r["over_all_resident"] <= res["bound_no_copies_over_all_resident"] + 1e-9, v
        assert r["peak_arena_over_capacity"] <= 1.0
        shares = r["hit_rate"] + r["prefetched_share"] + r["miss_share"] + r["arrived_share"]
        assert shares == pytest.approx(1.0)
        assert (r["arrived_share"] > 0) == (v.adopt == "device" and res["moves_per_subnet"] > 0)
        st = r["stalls"]
        assert st["count"] == st["first_forwards"] + st["after_export"]
        assert st["first_forwards"] <= st["of_first_forwards"]
        assert st["count"] > 0 and st["seconds_all_stages"] > 0  # a slow link stalls
        assert r["GB_per_subnet"]["fetched"] > 0
        if v.streams == 1:
            assert set(r["copy_stream_busy_share"]) <= {"h2d", "d2h"}
        assert r["copy_stream_busy_share"]["h2d"] <= 1 + 1e-9


def test_rows_and_verdicts(stream: Stream) -> None:
    base = baseline(stream, 2)
    res = run_setting(stream, 2, 4.0, 25e9, [2.0], RUNTIME_VARIANTS, base)
    assert res["all_resident"] == base and set(res["rows"]) == set(RUNTIME_VARIANTS)
    rows = [{"optimizer": "sgd", "placement": "device", "host_update_params_per_s": None,
             "oversubscription": 4.0, "M": 4, "host_link_GBps": 25.0, "policy": v.policy,
             "runtime": v.runtime, "window": 2, "prefetch_depth": v.depth, "copy_streams": v.streams, "adopt": v.adopt,
             "horizon": v.horizon,
             "over_best_all_resident": r["over_all_resident"], **r} for v, r in res["rows"].items()]
    (line,) = verdicts(rows, 4)
    best = max(r["over_all_resident"] for v, r in res["rows"].items() if v.policy == "belady")
    assert line["figure"] == best and line["met"] == (best >= 0.95) and line["as"] == "the runtime"
    assert line["placement"] == "device"
    assert depth_of("2", 5) == 2 and depth_of("w+1", 5) == 6 and depth_of("w", 3) == 3


def test_an_arena_too_small_for_one_subnet_is_reported(stream: Stream) -> None:
    split = memory_split(stream, 2, 1e4, 2.0, 25e9)
    assert "infeasible" in split
    res = run_setting(stream, 2, 1e4, 25e9, [2.0], RUNTIME_VARIANTS)
    assert res["infeasible"] is True and "infeasible" in res["arena_tried"]["2.0"]


def test_the_peer_tier_lends_the_holders_room_to_their_givers(stream: Stream) -> None:
    # P = 2: stage 1 holds for stage 0; only a giver peers and only a holder holds for its pair
    res = run_setting(stream, 2, 4.0, 25e9 / 1e4, [2.0], RUNTIME_VARIANTS[:1], peer_bw=150e9)
    assert not res.get("infeasible") and res["peer_link_GBps"] == 150.0
    assert res["held_for_pair_GB"][0] == 0.0 and 0.0 <= res["peered_share"] <= 1.0
    split = memory_split(stream, 2, 4.0, 2.0, 25e9 / 1e4, 150e9)
    assert all(p == 0.0 for p in split["peer"][1])  # the holder gives nothing
    assert split["acts"][1] >= memory_split(stream, 2, 4.0, 2.0, 25e9 / 1e4)["acts"][1]  # it keeps room to lend


def test_the_hybrid_placement_steps_ops_on_the_host_and_a_host_limit_steps_fewer(stream: Stream) -> None:
    device = run_setting(stream, 2, 4.0, 25e9 / 1e4, [2.0], RUNTIME_VARIANTS[:1])
    hybrid = run_setting(stream, 2, 4.0, 25e9 / 1e4, [2.0], RUNTIME_VARIANTS[:1], placement="hybrid")
    slow = run_setting(stream, 2, 4.0, 25e9 / 1e4, [2.0], RUNTIME_VARIANTS[:1], placement="hybrid",
                       host_update=1.0, host_limit=True)  # the host steps almost nothing while a subnet runs
    (d,), (h,), (lim,) = (x["rows"].values() for x in (device, hybrid, slow))
    assert d["host_update_share"] == 0.0 and d["GB_per_subnet"]["grads_to_host"] == 0.0
    assert 0 < h["host_update_share"] < 1 and h["GB_per_subnet"]["grads_to_host"] > 0
    assert h["GB_per_subnet"]["fetched"] < d["GB_per_subnet"]["fetched"]  # weights alone come up for host steps
    assert lim["host_update_share"] < h["host_update_share"]
    for r in (h, lim):
        assert r["peak_arena_over_capacity"] <= 1.0
        assert r["hit_rate"] + r["prefetched_share"] + r["miss_share"] + r["arrived_share"] == pytest.approx(1.0)
