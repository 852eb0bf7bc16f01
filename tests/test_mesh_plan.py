"""The mesh (rank layout, config errors) and the mesh planner (pipeline/plan/mesh.py): pure."""
from __future__ import annotations

import pytest

from pipeline.plan.mesh import mesh_options, recommend, reduce_seconds
from pipeline.plan.partition import OpCost, PartitionProblem
from pipeline.replicas import Mesh, MeshError


def test_layout_puts_a_replicas_stages_on_consecutive_ranks() -> None:
    m = Mesh.of(5, 6, 3, microbatches=4)
    assert (m.replica, m.stage, m.replicas) == (1, 2, 2)
    assert m.stage_ranks() == (3, 4, 5) and m.replica_ranks() == (2, 5)
    assert m.microbatches(4) == range(2, 4)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(MeshError, match=r"^pipeline\.stages: expected a divisor of the number of processes 4"):
        Mesh.of(0, 4, 3, microbatches=4)
    with pytest.raises(MeshError, match=r"^train\.microbatches: expected a multiple of the replica count 4"):
        Mesh.of(0, 4, 1, microbatches=6)


def problem(n: int, fwd: float, param_bytes: int) -> PartitionProblem:
    ops = tuple(OpCost(f"op{i}", fwd, 2 * fwd, param_bytes, param_bytes, 0) for i in range(n))
    return PartitionProblem(ops=ops, cut_bytes=(0,) * (n + 1), num_stages=1, num_microbatches=8)


def test_cheap_gradients_favour_replicas_and_heavy_ones_favour_stages() -> None:
    # 8 ops of 3 ms each: compute-bound with tiny weights -> pure data parallel (no bubble)
    light = recommend(mesh_options(problem(8, 1e-3, 1_000), 4, 8, 1, bandwidth=1e9, latency=0.0))
    assert (light.stages, light.replicas) == (1, 4)
    # 1 GB of weights per op over a 1 GB/s link: any reduction costs seconds -> pure pipeline
    heavy = recommend(mesh_options(problem(8, 1e-3, 10**9), 4, 8, 1, bandwidth=1e9, latency=0.0))
    assert (heavy.stages, heavy.replicas) == (4, 1)


def test_options_and_reduction_model() -> None:
    opts = mesh_options(problem(8, 1e-3, 100), 4, 2, 1, bandwidth=1e9, latency=0.0)
    assert [(o.stages, o.replicas) for o in opts] == [(2, 2), (4, 1)]  # R must divide M = 2
    assert reduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0
    assert reduce_seconds(1e9, 3, 1e9, 0.0) == pytest.approx(4.0)  # exact: 2 hops + 2 sends
    assert reduce_seconds(1e9, 4, 1e9, 0.0, mode="ring") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="pipeline.stages"):
        recommend([])


def test_settings_accept_auto_and_name_bad_fields() -> None:
    from pipeline import PipelineSettings

    assert PipelineSettings(stages="auto").stages == "auto"
    with pytest.raises(ValueError, match=r"^pipeline\.stages: expected a positive integer, 'auto' or null"):
        PipelineSettings(stages="deep")
    with pytest.raises(ValueError, match=r"^pipeline\.reduce: expected 'exact' or 'fast'"):
        PipelineSettings(reduce="ring")


def test_a_replica_takes_its_share_from_the_whole_batch_or_its_rows() -> None:
    import torch

    from pipeline.runtime import share_of

    x, y = torch.arange(24.0).reshape(12, 2), torch.arange(12)
    cpu = torch.device("cpu")
    for replicas, k in ((2, 0), (2, 1), (4, 3)):
        m = Mesh.of(k, replicas, 1, microbatches=4)
        share = m.microbatches(4)
        rows = range(share.start * 3, share.stop * 3)  # 12 rows / 4 micro-batches
        whole, size = share_of(x, y, 12, 4, share, cpu)
        part, size2 = share_of(x[rows.start:rows.stop], y[rows.start:rows.stop], 12, 4, share, cpu)
        assert size == size2 == 12 and len(whole) == len(part) == len(share)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(whole, part))
    with pytest.raises(ValueError, match="expected the whole batch"):
        share_of(x[:5], y[:5], 12, 4, range(0, 2), cpu)
