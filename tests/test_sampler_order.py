"""The locality order of the sampler's stream: the pure order (search.order), the samplers that
yield it (same archs per fair round or block, peek/next agreement, resume), its config fields,
the app recording it, and a pipelined run of it computing the one-process reference's bits."""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import open_dict

from search.config import ConfigError, load_config, train_digest
from search.order import locality_order, lru_hits, record_uses, reuse_distances
from search.samplers import SamplerError, check_order, make_sampler
from supernet import Arch, Choice, SearchSpace
from test_samplers import SPACE

WIDE = SearchSpace([Choice(f"l{i}", (0, 1, 2, 3)) for i in range(6)])  # the transformer test space's shape
KINDS = ["uniform", "fair"]


def stream(kind: str, order: str, n: int, space: SearchSpace = SPACE, seed: int = 0, **kw) -> list[Arch]:
    s = make_sampler(kind, space, seed, order=order, **kw)
    return [s.next() for _ in range(n)]


# -- the pure order --------------------------------------------------------------------------

def test_locality_order_is_a_deterministic_permutation_that_leaves_its_input_alone() -> None:
    rng = random.Random(0)
    for trial in range(50):
        block = [SPACE.random(rng) for _ in range(rng.randint(1, 7))]
        last = {(c.label, v): rng.randrange(10) for c in SPACE.choices for v in c.values if rng.random() < 0.5}
        saved = dict(last)
        order = locality_order(block, last, 10)
        assert sorted(order) == list(range(len(block))), trial
        assert locality_order(block, last, 10) == order and last == saved, trial


def test_locality_order_picks_the_obvious_arch() -> None:
    x1, y2, x2 = Arch({"a": "x", "b": 1}), Arch({"a": "y", "b": 2}), Arch({"a": "x", "b": 2})
    # no history and identical archs: ties, so index order
    assert locality_order([x1, y2, x2], {}, 0)[0] == 0
    assert locality_order([x1, x1, x1], {}, 0) == [0, 1, 2]
    # the arch whose ops the last step used goes first
    assert locality_order([x1, y2], {("a", "y"): 9, ("b", 2): 9}, 10) == [1, 0]
    # more recent beats less recent: y used 2 steps ago, x 5
    assert locality_order([x1, y2], {("a", "x"): 5, ("a", "y"): 8}, 10) == [1, 0]
    # the placed archs count as run: after x1, x2 reuses a=x at distance 1, y2 nothing
    assert locality_order([x1, y2, x2], {}, 0) == [0, 2, 1]
    # several ops reused a little later beat one reused at once: 1/2 + 1/2 + 1/2 > 1/1
    three = Arch({"a": "x", "b": 1, "c": "p"})
    other = Arch({"a": "y", "b": 2, "c": "q"})
    last = {("a", "x"): 8, ("b", 1): 8, ("c", "p"): 8, ("a", "y"): 9}
    assert locality_order([other, three], last, 10) == [1, 0]
    # an exact tie goes to the lower index: 1/2 + 1/2 == 1/1
    last = {("a", "x"): 8, ("b", 1): 8, ("a", "y"): 9}
    assert locality_order([x1, y2], last, 10) == [0, 1] and locality_order([y2, x1], last, 10) == [0, 1]


def test_reuse_statistics_on_a_hand_built_stream() -> None:
    archs = [Arch({"a": "x", "b": 1}), Arch({"a": "x", "b": 2}), Arch({"a": "y", "b": 1}), Arch({"a": "x", "b": 1})]
    assert reuse_distances(archs) == [1, 2, 2, 1]  # a=x at 1; b=1 at 2; a=x at 3 (from 1); b=1 at 3 (from 2)
    assert lru_hits(archs, 2) == 2  # only the previous step's ops: a=x at step 1, b=1 at step 3
    assert lru_hits(archs, 4) == 4
    assert record_uses(archs[:2], {("b", 3): 0}, 5) == {("b", 3): 0, ("a", "x"): 6, ("b", 1): 5, ("b", 2): 6}
    with pytest.raises(ValueError, match="capacity: expected an integer >= 1, found 0"):
        lru_hits(archs, 0)


# -- the sampler's stream --------------------------------------------------------------------

@pytest.mark.parametrize("kind, block", [("fair", 4), ("uniform", 4), ("uniform", 3), ("uniform", 7)])
def test_locality_yields_each_block_of_the_stream_in_another_order(kind: str, block: int) -> None:
    kw = {"block": block} if kind == "uniform" and block != 4 else {}
    plain, ordered = stream(kind, "stream", 20 * block), stream(kind, "locality", 20 * block, **kw)
    assert make_sampler(kind, SPACE, 0, order="locality", **kw).block == block
    for b in range(0, len(plain), block):
        assert Counter(ordered[b : b + block]) == Counter(plain[b : b + block]), b
    assert ordered != plain  # the order does change something
    assert ordered == stream(kind, "locality", 20 * block, **kw)  # and is a function of the seed
    assert ordered != stream(kind, "locality", 20 * block, seed=1, **kw)


def test_fair_rounds_keep_their_counts_with_the_locality_order() -> None:
    archs, n = stream("fair", "locality", 48), 4
    for r in range(0, len(archs), n):
        assert Counter(a["a"] for a in archs[r : r + n]) == Counter("xyzw")  # every candidate once a round
        for c in SPACE.choices:  # the narrower labels: counts over whole rounds as the stream's
            assert (Counter(a[c.label] for a in archs[: r + n])
                    == Counter(a[c.label] for a in stream("fair", "stream", r + n)))


@pytest.mark.parametrize("kind", KINDS)
def test_peek_equals_next_under_random_peek_patterns(kind: str) -> None:
    expected = stream(kind, "locality", 80)
    for seed in range(5):
        rng, s, got = random.Random(seed), make_sampler(kind, SPACE, 0, order="locality"), []
        while len(got) < 60:
            k = rng.randrange(9)
            assert s.peek(k) == expected[len(got) : len(got) + k]
            got += [s.next() for _ in range(rng.randrange(k + 1))]
        assert got[:60] == expected[:60], seed


@pytest.mark.parametrize("kind", KINDS)
def test_resume_mid_block_continues_the_same_order(kind: str) -> None:
    expected = stream(kind, "locality", 30)
    for stop in (1, 6, 9, 13):  # blocks of 4: mostly inside one
        first = make_sampler(kind, SPACE, 0, order="locality")
        head = [first.next() for _ in range(stop)]
        first.peek(5)
        state = first.state_dict()
        assert state["order"] == "locality" and state["block"] == 4 and state["consumed"] == stop
        resumed = make_sampler(kind, SPACE, 0, order="locality")
        resumed.load_state_dict(state)
        assert head + [resumed.next() for _ in range(30 - stop)] == expected, stop


def test_a_state_of_another_order_or_block_is_refused() -> None:
    plain = make_sampler("uniform", SPACE, 0)
    assert plain.state_dict()["order"] == "stream" and plain.state_dict()["block"] is None
    local = make_sampler("uniform", SPACE, 0, order="locality")
    with pytest.raises(SamplerError, match="saved order is 'stream' but this sampler has 'locality'"):
        local.load_state_dict(plain.state_dict())
    with pytest.raises(SamplerError, match="saved block is 4 but this sampler has 3"):
        make_sampler("uniform", SPACE, 0, order="locality", block=3).load_state_dict(local.state_dict())
    old = {k: v for k, v in plain.state_dict().items() if k not in ("order", "block")}  # an older checkpoint's
    plain.load_state_dict({**old, "consumed": 3})
    assert plain.consumed == 3
    with pytest.raises(SamplerError, match="saved order is 'stream'"):
        local.load_state_dict(old)


@pytest.mark.parametrize("name, order, block, message", [
    ("uniform", "nearest", None, r"sampler.order: expected one of \['stream', 'locality'\], found 'nearest'"),
    ("fixed", "locality", None, r"sampler.order: expected 'stream' for the fixed sampler .*found 'locality'"),
    ("uniform", "locality", 1, r"sampler.block: expected an integer >= 2 or null, found 1"),
    ("uniform", "locality", True, r"sampler.block: expected an integer >= 2 or null, found True"),
    ("fair", "locality", 3, r"sampler.block: expected null for the fair sampler .*found 3"),
    ("uniform", "stream", 3, r"sampler.block: expected null with sampler.order=stream .*found 3"),
])
def test_bad_order_or_block_names_the_field(name: str, order: str, block, message: str) -> None:
    with pytest.raises(SamplerError, match=message):
        check_order(name, order, block)
    arch = dict(SPACE.random(random.Random(0))) if name == "fixed" else None
    with pytest.raises(SamplerError, match=message):
        make_sampler(name, SPACE, 0, arch, order=order, block=block)


@pytest.mark.parametrize("space", [SPACE, WIDE], ids=["mixed", "wide"])
@pytest.mark.parametrize("kind", KINDS)
def test_locality_order_raises_the_hits_of_a_small_cache(kind: str, space: SearchSpace) -> None:
    # 400 steps, seed 0; LRU hits of choice ops with room for 1, 1.5 and 2 steps' ops
    # (1 step: the ops each subnet shares with the one before). Measured, stream -> locality:
    #   mixed (4 labels of 4, 2, 3, 1 values) fair     559 -> 893,  881 -> 1016, 1216 -> 1238
    #                                         uniform  857 -> 1027, 1119 -> 1181, 1363 -> 1378
    #   wide (6 labels of 4 values)           fair     142 -> 282,  317 -> 498,  503 -> 673
    #                                         uniform  598 -> 843,  876 -> 1058, 1157 -> 1281
    # The mean reuse distance hardly moves (mixed fair 2.496 -> 2.495): for each op the
    # distances sum to its last use minus its first, whatever the order within blocks.
    plain, ordered = stream(kind, "stream", 400, space), stream(kind, "locality", 400, space)
    labels = len(space)
    for capacity in (labels, labels + labels // 2, 2 * labels):
        assert lru_hits(ordered, capacity) >= lru_hits(plain, capacity), capacity
    assert lru_hits(ordered, labels) > lru_hits(plain, labels)


# -- config, app and pipeline ----------------------------------------------------------------

def test_config_reads_and_checks_the_order(tmp_path: Path) -> None:
    from test_app import make_cfg

    rc = load_config(make_cfg("sampler.order=locality", "sampler.block=3"))
    assert (rc.sampler.order, rc.sampler.block) == ("locality", 3)
    assert (load_config(make_cfg("sampler=fair")).sampler.order, load_config(make_cfg()).sampler.block) == ("stream", None)
    for overrides, message in [
        (["sampler.order=nearest"], "sampler.order: expected one of ['stream', 'locality'], found 'nearest'"),
        (["sampler.order=locality", "sampler.block=1"], "sampler.block: expected an integer >= 2 or null, found 1"),
        (["sampler.block=4"], "sampler.block: expected null with sampler.order=stream (only the locality order"),
        (["sampler=fair", "sampler.order=locality", "+sampler.block=4"], "sampler.block: expected null for the fair"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(make_cfg(*overrides))
        assert str(e.value).startswith(message) and "\n" not in str(e.value), overrides
    # the default order leaves the train digest as it was before there was a choice
    base, before = train_digest(make_cfg()), make_cfg()
    with open_dict(before):  # the sampler group as it was before there was an order
        before.sampler.pop("order"), before.sampler.pop("block")
    assert train_digest(before) == base
    assert train_digest(make_cfg("sampler=fair")) == train_digest(make_cfg("sampler=fair", "~sampler.order"))
    local = train_digest(make_cfg("sampler.order=locality"))
    assert len({base, local, train_digest(make_cfg("sampler.order=locality", "sampler.block=3"))}) == 3


def test_app_trains_the_locality_order_records_it_and_refuses_to_resume_another(tmp_path: Path) -> None:
    from search.app import prepare, run
    from search.checkpoint import CheckpointError
    from supernet import derive_seed
    from test_app import make_cfg, read_metrics

    cfg = make_cfg("sampler=fair", "sampler.order=locality", "train.steps=8", "train.checkpoint_every=0")
    p = prepare(cfg, tmp_path)
    summary = run(cfg, prepared=p)
    assert summary["sampler"] == {"name": "fair", "order": "locality", "block": 5}  # the tiny conv space: 5 values
    assert json.loads((tmp_path / "summary.json").read_text())["sampler"] == summary["sampler"]
    trained = [m["arch"] for m in read_metrics(tmp_path)]
    space, seed = p.graph.space(), derive_seed(p.rc.seed, "sampler")
    assert trained == [dict(a) for a in stream("fair", "locality", 8, space, seed)]
    assert trained[:5] != [dict(a) for a in stream("fair", "stream", 5, space, seed)]
    with pytest.raises(CheckpointError, match=r"sampler.order \('locality' -> \(unset\)\)"):
        run(make_cfg("sampler=fair", "train.steps=8", "train.checkpoint_every=0"), output_dir=tmp_path)


@pytest.mark.dist
def test_pipelined_locality_order_computes_the_reference_bits() -> None:
    from distributed import Scenario, assert_same_as_reference, run_scenario, spawn
    from test_memory import tight_budget

    # two fair rounds of the conv space (5 values), so the second round's order depends on the
    # first's, through stages whose tensor manager must evict. Measured per rank (P = 2, 1F1B):
    # hits 25/35 with either order, evictions 12/20 (locality) vs 12/22 (stream), host updates
    # 15/23 vs 15/25; ten steps of a 4-label space say little, hence no assertion on them.
    memory = {"device_budget_bytes": tight_budget("conv", "sgd", 10)}
    scenarios = [Scenario("conv", "1f1b", steps=10, sampler="fair", order=order, memory=memory)
                 for order in ("locality", "stream")]
    results, _, _ = spawn(2, scenarios, timeout_s=300)
    refs = []
    for sc, got in zip(scenarios, results):
        ref = run_scenario(Scenario(**{**sc.__dict__, "memory": {}}))  # one process, all resident
        ref.pop("engine")
        assert_same_as_reference(got, ref, f"conv/1f1b P=2 fair {sc.order}")
        assert sum(got["evictions"]) > 0, f"{sc.order}: the budget should force evictions"
        refs.append(ref)
    assert refs[0]["losses"] != refs[1]["losses"]  # another order: other steps' subnets
