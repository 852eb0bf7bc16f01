"""Metrics while training (search/metrics.py): metrics.csv and TensorBoard scalars beside
metrics.jsonl, read back; the reference subnets scored every ``train.monitor_every`` steps without
changing training (flushed, cross-subnet windows, delayed shared ops, a 2-stage torchrun job);
resume; the config's switches."""
from __future__ import annotations

import csv
import json
import logging
import re
import sys
from pathlib import Path

import pytest

import pipeline.reference
from search.app import prepare, run
from search.config import ConfigError, load_config, train_digest, train_fields
from search.evolution import SubnetCost
from search.metrics import STEP_FIELDS, MetricsWriter, Monitor, reference_archs, tensorboard_available
from supernet import SearchSpaceError
from supernet.spaces import conv
from tests.cli_driver import torchrun_search
from tests.test_app import ROOT, TINY, TINY_CONV, crash_at, make_cfg, read_metrics

MONITORED = ["monitor/smallest", "monitor/middle", "monitor/largest"]
DELAYED = ["pipeline.window=4", "pipeline.shared_ops=delayed", "pipeline.shared_delay=1", "sampler=fair"]
needs_tb = pytest.mark.skipif(not tensorboard_available(),
                              reason="needs tensorboard (pip install 'pipenas[tensorboard]')")


def read_csv(out: Path) -> tuple[list[str], list[dict[str, str]]]:
    with (out / "metrics.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def cell(v: object) -> str:
    """How metrics.csv writes a value of metrics.jsonl."""
    return "" if v is None else json.dumps(v) if isinstance(v, dict) else str(v)


def assert_csv_is_jsonl(out: Path) -> list[dict]:
    """metrics.csv: one row per metrics.jsonl line, the same values; every key a column."""
    header, rows = read_csv(out)
    metrics = read_metrics(out)
    assert len(rows) == len(metrics) and header[:len(STEP_FIELDS)] == list(STEP_FIELDS)
    for row, m in zip(rows, metrics):
        assert set(m) <= set(header)
        assert row == {k: cell(m.get(k)) for k in header}
        assert float(row["loss"]) == m["loss"] and json.loads(row["arch"]) == m["arch"]  # exact round trip
    return metrics


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def without_timings(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in ("samples_per_s", "seconds", "monitor_s")} for m in metrics]


def trained(metrics: list[dict]) -> list[dict]:
    """What training computed at each step (not how long it took, where ops were, or the scores)."""
    return [{k: m.get(k) for k in ("step", "arch", "loss", "lr", "nonfinite")} for m in metrics]


def scored(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k == "step" or k in MONITORED} for m in metrics if "monitor_s" in m]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The tiny space's reference subnets."""
    p = prepare(make_cfg(), output_dir=tmp_path_factory.mktemp("prepared"))
    return {name: dict(a) for name, a in reference_archs(p.graph.space(), p.cost).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, refs: dict) -> dict[str, tuple[Path, dict]]:
    """The tiny run monitored every 4 steps and not at all; with a cross-subnet window, monitored.
    The search scores the reference subnets first (its seed archs)."""
    seeds = "search.seed_archs=[" + ", ".join(
        "{" + ", ".join(f"{k}: {v}" for k, v in a.items()) + "}" for a in refs.values()) + "]"
    out = {}
    for name, extra in {"monitored": ["train.monitor_every=4"], "plain": ["train.monitor_every=0"],
                        "window": ["pipeline.window=4", "train.monitor_every=4"]}.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = d, run(make_cfg(*extra, seeds), output_dir=d)
    return out


# -- a run's files -------------------------------------------------------------------------------

def test_monitored_steps_carry_the_reference_subnets_accuracy_and_change_nothing(runs: dict, refs: dict) -> None:
    (out, summary), (plain_out, plain) = runs["monitored"], runs["plain"]
    metrics = assert_csv_is_jsonl(out)
    assert [m["step"] for m in metrics] == list(range(12))
    watched = [m for m in metrics if "monitor_s" in m]
    assert [m["step"] for m in watched] == [3, 7, 11]  # after 4, 8 and 12 steps trained
    for m in metrics:  # the step lines of before, plus the monitor's columns after a monitored step
        assert [k for k in m if not k.startswith("monitor")] == list(STEP_FIELDS[:-1])
    for m in watched:
        assert [k for k in m if k.startswith("monitor")] == [*MONITORED, "monitor_s"]
        assert all(0 <= m[k] <= 1 for k in MONITORED) and m["monitor_s"] > 0

    # scoring restores batch norm and touches nothing else: the same training bit for bit
    assert summary["params_digest"] == plain["params_digest"]
    plain_metrics = read_metrics(plain_out)
    assert without_timings(metrics) == without_timings(
        [{**m, **{k: v for k, v in w.items() if k.startswith("monitor")}} for m, w in zip(plain_metrics, metrics)])
    assert summary["top_k"] == plain["top_k"]
    header, _ = read_csv(plain_out)
    assert header == list(STEP_FIELDS) and not any("monitor_s" in m for m in plain_metrics)  # off: no columns

    # the last scoring (after the last step) is the search's own evaluation of those archs
    logged = {json.dumps(e["arch"], sort_keys=True): e["val_accuracy"]
              for e in map(json.loads, (out / "search-evolution.jsonl").read_text().splitlines())}
    assert {watched[-1][f"monitor/{name}"] for name in refs} == {
        logged[json.dumps(a, sort_keys=True)] for a in refs.values()} and len(refs) == 3


@needs_tb
def test_tensorboard_scalars_are_the_metrics(runs: dict) -> None:
    out, _ = runs["monitored"]
    metrics = read_metrics(out)
    tb = scalars(out)
    assert {"train/loss", "train/lr", "train/samples_per_s", "memory/resident_bytes_peak", *MONITORED,
            "monitor/monitor_s"} <= tb.keys()
    assert [s for s, _ in tb["train/loss"]] == list(range(12))
    assert [v for _, v in tb["train/loss"]] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)  # float32
    assert [v for _, v in tb["train/lr"]] == pytest.approx([m["lr"] for m in metrics], rel=1e-6)
    for tag in MONITORED:
        assert tb[tag] == [(m["step"], pytest.approx(m[tag], rel=1e-6)) for m in metrics if tag in m]


def test_cross_subnet_windows_are_scored_at_the_end_of_the_segment_that_reaches_the_step(runs: dict) -> None:
    # segments end at checkpoints (train.checkpoint_every=5): [0, 5), [5, 10), [10, 12); each reaches a multiple of 4
    out, summary = runs["window"]
    metrics = assert_csv_is_jsonl(out)
    assert [m["step"] for m in metrics if "monitor_s" in m] == [4, 9, 11]
    assert summary["params_digest"] == runs["plain"][1]["params_digest"]  # an exact window: sequential training


def test_scoring_leaves_delayed_shared_ops_alone(runs: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ops read late keep versions per boundary; scoring between segments must not touch them."""
    with caplog.at_level(logging.INFO, logger="search.app"):
        on = run(make_cfg(*DELAYED, "train.monitor_every=4"), output_dir=tmp_path / "on")
    lines = [r.getMessage() for r in caplog.records if "reference subnets" in r.getMessage()]
    assert [ln.split(":")[0] for ln in lines] == ["[rank 0] step 5/12", "[rank 0] step 10/12", "[rank 0] step 12/12"]
    assert all(re.search(r"smallest [01]\.\d{4}, middle [01]\.\d{4}, largest [01]\.\d{4} \(", ln) for ln in lines)
    off = run(make_cfg(*DELAYED, "train.monitor_every=0", "train.tensorboard=false"), output_dir=tmp_path / "off")
    assert on["params_digest"] == off["params_digest"] != runs["plain"][1]["params_digest"]
    assert [m["step"] for m in read_metrics(tmp_path / "on") if "monitor_s" in m] == [4, 9, 11]
    assert not (tmp_path / "off" / "tb").exists()  # train.tensorboard=false


def test_resume_keeps_csv_and_tensorboard_consistent(runs: dict, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out, uninterrupted = runs["monitored"]
    real_step = crash_at(monkeypatch, 7)
    with pytest.raises(RuntimeError, match="node lost"):
        run(make_cfg("train.monitor_every=4"), output_dir=tmp_path)
    assert [m["step"] for m in assert_csv_is_jsonl(tmp_path)] == list(range(7))  # the checkpoint is at step 5
    monkeypatch.setattr(pipeline.reference.ReferenceEngine, "train_step", real_step)
    resumed = run(make_cfg("train.monitor_every=4"), output_dir=tmp_path)
    assert resumed["resumed_from_step"] == 5 and resumed["params_digest"] == uninterrupted["params_digest"]
    metrics = assert_csv_is_jsonl(tmp_path)  # steps 5 and 6 once each, in the CSV too
    assert without_timings(metrics) == without_timings(read_metrics(out))
    if tensorboard_available():  # the first writer's steps 5 and 6 are purged: each step once
        tb = scalars(tmp_path)
        assert [s for s, _ in tb["train/loss"]] == list(range(12))
        assert [s for s, _ in tb["monitor/largest"]] == [3, 7, 11]


def test_a_resumed_writer_in_the_same_second_sorts_after_the_first(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard reads event files in name order (second, host, pid, an unpadded counter): with
    the counter at 9 and 10 in one second, the resumed file sorted first and the first file's
    steps purged the resumed ones (seen once in CI under pytest-xdist)."""
    if not tensorboard_available():
        pytest.skip("tensorboard is not installed")
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    for start, stop in ((0, 4), (2, 6)):
        w = MetricsWriter(tmp_path, start, [])
        for step in range(start, stop):
            w.step({"step": step, "loss": 1.0 / (step + 1)})
        w.close()
    files = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert [f.name.rsplit(".", 1)[1] for f in files] == ["9", "10"]  # name order is the order they were made
    assert [s for s, _ in scalars(tmp_path)["train/loss"]] == list(range(6))


def test_a_resume_with_other_monitor_settings_keeps_the_old_columns(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, 0, ["monitor/a", "monitor_s"], tensorboard=False)
    for step in range(4):
        w.step({"step": step, "loss": 1.0 / (step + 1)}, hold=step == 1)
        if step == 1:
            w.monitored({"monitor/a": 0.5, "monitor_s": 0.1})
    w.close()
    w = MetricsWriter(tmp_path, 3, [], tensorboard=False)  # resumed at step 3, monitoring off
    assert w.losses == [1.0, 0.5, 1 / 3]
    w.step({"step": 3, "loss": None, "nonfinite": "skip"}, hold=True)  # held: written on close
    w.close()
    header, rows = read_csv(tmp_path)
    assert header == [*STEP_FIELDS, "monitor/a", "monitor_s"]
    assert [r["monitor/a"] for r in rows] == ["", "0.5", "", ""] and rows[3]["nonfinite"] == "skip"
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3]
    with pytest.raises(ValueError):  # a key that is not a column fails loudly
        MetricsWriter(tmp_path, 4, [], tensorboard=False).step({"step": 4, "typo": 1})


# -- the reference subnets ---------------------------------------------------------------------

def test_reference_archs_by_parameters_and_given() -> None:
    graph = conv.build(input_shape=(1, 8, 8), num_classes=10)  # the default space
    space, cost = graph.space(), SubnetCost(graph, (1, 8, 8))
    refs = reference_archs(space, cost)
    assert list(refs) == ["smallest", "middle", "largest"]
    assert refs["smallest"] == cost.cheapest(space, "params")[0]
    params = [cost.params(a) for a in refs.values()]
    assert params == sorted(params) and len(set(params)) == 3
    arch = dict(refs["largest"])
    assert reference_archs(space, cost, [arch, arch, dict(refs["smallest"])]) == {  # the same arch once
        "arch0": refs["largest"], "arch2": refs["smallest"]}
    with pytest.raises(SearchSpaceError, match=r"^train\.monitor_archs\[1\]\.layer00: expected one of"):
        reference_archs(space, cost, [arch, {**arch, "layer00": "k7e9"}])


def test_monitor_is_due_where_a_segment_reaches_a_multiple() -> None:
    m = Monitor({}, 100, [], [])
    assert [k for k in range(300) if m.due(k, k + 1)] == [99, 199, 299]  # one step a segment
    assert [m.due(a, b) for a, b in [(64, 96), (96, 128), (128, 160), (180, 200), (200, 232)]] == [
        False, True, False, True, False]
    assert not Monitor({}, 0, [], []).due(0, 10**6)  # 0: never
    import torch

    batches = [(torch.arange(4), torch.arange(4)), (torch.arange(4, 8), torch.arange(4, 8))]
    assert [y.tolist() for _, y in Monitor({}, 1, batches, [], samples=6).val] == [[0, 1, 2, 3], [4, 5]]


# -- the config --------------------------------------------------------------------------------

def test_recording_settings_are_not_training_settings() -> None:
    base = make_cfg()
    other = make_cfg("train.monitor_every=7", "train.tensorboard=false", "train.monitor_samples=10",
                     "train.monitor_archs=[{layer00: skip, layer01: k3e3}]", "train.log_every=3")
    assert train_digest(base) == train_digest(other)  # a checkpoint resumes with other monitoring
    assert not {"tensorboard", "monitor_every", "monitor_archs", "monitor_samples"} & set(train_fields(base)["train"])
    t = load_config(other).train
    assert (t.monitor_every, t.tensorboard, t.monitor_samples, t.monitor_archs) == (
        7, False, 10, ({"layer00": "skip", "layer01": "k3e3"},))


@pytest.mark.parametrize("override, message", [
    ("train.tensorboard=maybe", "train.tensorboard: expected auto, true or false, found 'maybe'"),
    ("train.monitor_every=-1", "train.monitor_every: expected an integer >= 0, found -1"),
    ("train.monitor_archs=[skip]", "train.monitor_archs[0]: expected a mapping label -> value, found 'skip'"),
    ("train.monitor_samples=0", "train.monitor_samples: expected an integer >= 1 or null, found 0"),
])
def test_bad_recording_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(make_cfg(override))
    assert str(e.value) == message


def test_tensorboard_true_without_the_package_is_a_config_error(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    assert not tensorboard_available()
    with pytest.raises(ConfigError, match=r"^train\.tensorboard: expected the tensorboard package with true, "
                                          r"found it not installed; pip install 'pipenas\[tensorboard\]'"):
        load_config(make_cfg("train.tensorboard=true"))
    assert load_config(make_cfg()).train.tensorboard == "auto"  # auto: writes none, says nothing
    MetricsWriter(tmp_path, 0, tensorboard="auto").close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]


# -- torchrun ----------------------------------------------------------------------------------

@pytest.mark.dist
def test_torchrun_two_stages_score_alike_and_train_alike(tmp_path: Path) -> None:
    """Scoring is collective (every stage, the same archs after the same step) and moves ops for
    the scored subnet's partition; training after it is the one-process run's, bit for bit."""
    one = run(make_cfg(*DELAYED, "train.monitor_every=4"), output_dir=tmp_path / "one")
    args = [*TINY_CONV, *TINY, *DELAYED, "train.monitor_every=4", "pipeline.timeout_s=60", "pipeline.stages=2",
            f"hydra.run.dir={tmp_path}/run"]
    done = torchrun_search(args, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params_digest"] == one["params_digest"]
    metrics, alone = assert_csv_is_jsonl(tmp_path / "run"), read_metrics(tmp_path / "one")
    assert trained(metrics) == trained(alone)
    assert scored(metrics) == scored(alone) and [m["step"] for m in scored(metrics)] == [4, 9, 11]  # the same scores
