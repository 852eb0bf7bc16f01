"""The measured profiler: coverage, bytes that agree with the analytic model, the disk cache, the fallback."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline import profile
from pipeline.plan.costs import CostTable, analytic_costs, subnet_problem
from pipeline.plan.partition import solve
from pipeline.profile import ProfileError, cost_table, measured_costs, profile_key, shared_profile
from supernet.spaces import build_space

SHAPE = (8, 12)  # 8 tokens of 12 features
MB = 2


def tiny(layers: int = 3, width: int = 16, candidates=("attn2", "ffn2", "conv3", "identity")):
    return build_space("transformer", input_shape=SHAPE, num_classes=5, layers=layers, width=width,
                       candidates=list(candidates))


def fast(graph, tmp_path, **kw) -> CostTable:
    return measured_costs(graph, SHAPE, MB, "sgd", "cpu", warmup=0, repeats=1, cache_dir=tmp_path, **kw)


def test_table_covers_every_slot_with_positive_times_and_analytic_bytes(tmp_path) -> None:
    g = tiny()
    table = fast(g, tmp_path)
    ref = analytic_costs(g, SHAPE, MB, "sgd")
    assert table.source == "measured:cpu" and table.microbatch == MB
    assert set(table.ops) == {s.op_id for s in g.slots()}
    assert set(table.out_bytes) == set(ref.out_bytes)
    for op_id, c in table.ops.items():
        assert c.op_id == op_id
        assert c.fwd > 0 and c.bwd > 0, op_id
        assert c.param_bytes == ref.ops[op_id].param_bytes, op_id
        assert c.optim_bytes == ref.ops[op_id].optim_bytes, op_id
    assert dict(table.out_bytes) == dict(ref.out_bytes)
    # kept activations: a real block keeps at least its output; identity keeps nothing new
    assert table.ops["layer00/identity"].act_bytes == 0
    out = MB * SHAPE[0] * 16 * 4
    for cand in ("attn2", "ffn2", "conv3"):
        assert table.ops[f"layer00/{cand}"].act_bytes >= out, cand
    # the attention keeps its (mb, heads, t, t) scores on top of the ffn-sized tensors
    assert table.ops["layer00/attn2"].act_bytes > table.ops["layer00/conv3"].act_bytes


def test_optimizer_state_bytes_follow_the_optimizer(tmp_path) -> None:
    g = tiny(layers=1)
    sgd = fast(g, tmp_path)
    adamw = measured_costs(g, SHAPE, MB, "adamw", "cpu", warmup=0, repeats=1, cache_dir=tmp_path)
    for op_id in sgd.ops:
        assert adamw.ops[op_id].optim_bytes == 2 * sgd.ops[op_id].optim_bytes


def test_identical_specs_share_one_measurement(tmp_path, monkeypatch) -> None:
    measured = []
    real = profile._time_units

    def counting(units, *a):
        measured.extend(u.ctx.op_id for u in units)
        return real(units, *a)

    monkeypatch.setattr(profile, "_time_units", counting)
    g = tiny(layers=4)
    table = fast(g, tmp_path, use_cache=False)
    # stem, head and the 4 candidates of the first layer; the later layers repeat them
    assert sorted(measured) == sorted(["stem", "head", *(f"layer00/{c}" for c in ("attn2", "ffn2", "conv3", "identity"))])
    assert table.ops["layer03/attn2"].fwd == table.ops["layer00/attn2"].fwd


def test_cache_hit_returns_equal_table_without_measuring(tmp_path, monkeypatch) -> None:
    g = tiny()
    calls = []
    real = profile._measure

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(profile, "_measure", counting)
    first = fast(g, tmp_path)
    second = fast(g, tmp_path)
    assert len(calls) == 1
    assert second == first
    files = list(tmp_path.glob("profile-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
    # a different micro-batch is a different profile
    measured_costs(g, SHAPE, MB * 2, "sgd", "cpu", warmup=0, repeats=1, cache_dir=tmp_path)
    assert len(calls) == 2
    # the cache dir comes from $PIPENAS_CACHE by default
    monkeypatch.setenv("PIPENAS_CACHE", str(tmp_path))
    assert measured_costs(g, SHAPE, MB, "sgd", "cpu", warmup=0, repeats=1) == first
    assert len(calls) == 2


def test_unreadable_cache_is_measured_again(tmp_path, monkeypatch) -> None:
    g = tiny(layers=1)
    first = fast(g, tmp_path)
    (path,) = tmp_path.glob("profile-*.json")
    path.write_text("{not json")
    calls = []
    real = profile._measure
    monkeypatch.setattr(profile, "_measure", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    again = fast(g, tmp_path)
    assert len(calls) == 1 and set(again.ops) == set(first.ops)
    assert json.loads(path.read_text())["table"]["source"] == "measured:cpu"


def test_cache_key_changes_with_shape_graph_optimizer_and_dtype() -> None:
    g = tiny()
    base, fields = profile_key(g, SHAPE, MB, "sgd", "cpu")
    assert fields["torch"] == torch.__version__ and fields["device"] == "cpu"
    assert profile_key(g, SHAPE, MB, "sgd", "cpu")[0] == base
    assert fields["clock"] == "thread-cpu"  # the autouse fixture runs tests with one thread
    torch.set_num_threads(2)  # CPU times depend on the thread count, and so does the clock
    try:
        key2, fields2 = profile_key(g, SHAPE, MB, "sgd", "cpu")
    finally:
        torch.set_num_threads(1)
    assert key2 != base and fields2["clock"] == "wall"
    assert profile_key(g, (4, 12), MB, "sgd", "cpu")[0] != base
    assert profile_key(g, SHAPE, MB + 1, "sgd", "cpu")[0] != base
    assert profile_key(g, SHAPE, MB, "adamw", "cpu")[0] != base
    assert profile_key(g, SHAPE, MB, "sgd", "cpu", torch.float64)[0] != base
    assert profile_key(tiny(width=32), SHAPE, MB, "sgd", "cpu")[0] != base
    assert profile_key(tiny(candidates=("attn2", "ffn4")), SHAPE, MB, "sgd", "cpu")[0] != base


def test_analytic_fallback_and_sources(tmp_path) -> None:
    g = tiny()
    analytic = cost_table("analytic", g, SHAPE, MB)
    assert analytic.source == "analytic" and analytic == analytic_costs(g, SHAPE, MB)
    measured = cost_table("measured", g, SHAPE, MB, warmup=0, repeats=1, cache_dir=tmp_path)
    assert set(measured.ops) == set(analytic.ops)
    with pytest.raises(ProfileError, match="expected 'measured' or 'analytic'"):
        cost_table("guess", g, SHAPE, MB)
    with pytest.raises(ProfileError, match="analytic_costs"):
        measured_costs(g, SHAPE, MB, device="meta")


def test_measured_table_plans_a_subnet(tmp_path) -> None:
    import random

    g = tiny(layers=4)
    table = fast(g, tmp_path)
    arch = g.space().random(random.Random(0))
    problem = subnet_problem(g, g.active_ops(arch), table, 2, 4, "1f1b", 1e9, 1e-5)
    part = solve(problem)
    assert part.bounds[0] == 0 and part.bounds[-1] == len(g.active_ops(arch))


def test_shared_profile_single_process_measures_locally(tmp_path) -> None:
    g = tiny(layers=1)
    assert shared_profile(g, SHAPE, MB, "sgd", 0, 1, "cpu", warmup=0, repeats=1, cache_dir=tmp_path) == fast(g, tmp_path)


_RANK_MAIN = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from pipeline.profile import shared_profile, table_to_json
from supernet.spaces import build_space
rank, tmp = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
g = build_space("transformer", input_shape=(8, 12), num_classes=5, layers=2, width=16,
                candidates=["attn2", "ffn2", "conv3", "identity"])
t = shared_profile(g, (8, 12), 2, "sgd", rank, 2, "cpu", warmup=0, repeats=1, cache_dir=f"{tmp}/cache{rank}")
with open(f"{tmp}/rank{rank}.json", "w") as f:
    json.dump(table_to_json(t), f)
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_shared_profile_is_measured_on_rank0_and_broadcast(tmp_path) -> None:
    from pathlib import Path

    from tests.cli_driver import child_env
    from tests.zygote import collect, launch

    root = Path(__file__).resolve().parents[1]
    env = child_env(OMP_NUM_THREADS="1")
    procs = [launch(["-c", _RANK_MAIN, str(r), str(tmp_path)], env, root) for r in range(2)]
    for r, d in enumerate(collect(procs, 120)):
        assert d is not None, f"rank {r} did not finish within 120 s"
        assert d.returncode == 0, f"rank {r} exited {d.returncode}:\n{d.stderr[-3000:]}"
    tables = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert tables[0] == tables[1]
    assert list((tmp_path / "cache0").glob("profile-*.json"))  # rank 0 measured and cached
    assert not (tmp_path / "cache1").exists()  # rank 1 never measured


@pytest.mark.parametrize("space, options", [
    ("transformer", dict(layers=2, width=16, dropout=0.1,
                         candidates=["attn2", "attn4", "ffn2", "conv3", "sepconv5", "lightconv3h4", "glu", "identity"])),
    ("conv", {}), ("cell", {}), ("resmlp", {}),
])
def test_analytic_kept_bytes_equal_the_measured_ones_on_every_builtin_space(tmp_path, space, options) -> None:
    """The analytic model counts what a training forward keeps for its backward, as the CPU
    profiler measures it, not every tensor the forward makes (2-3x more on attention)."""
    shape = (8, 12) if space == "transformer" else (1, 8, 8)
    g = build_space(space, input_shape=shape, num_classes=5, **options)
    measured = measured_costs(g, shape, MB, "sgd", "cpu", warmup=0, repeats=1, cache_dir=tmp_path)
    analytic = analytic_costs(g, shape, MB, "sgd")
    assert {k: c.act_bytes for k, c in analytic.ops.items()} == {k: c.act_bytes for k, c in measured.ops.items()}
    assert any(c.act_bytes > 0 for c in analytic.ops.values())
