"""The search app end to end: outputs, determinism, resume, bad input (the command line: tests/test_cli.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipeline.reference
from pipeline import params_digest
from search.__main__ import torchrun_argv
from search.app import run
from search.checkpoint import CheckpointError, load_checkpoint
from search.config import ConfigError
from search.evolution import SubnetCost
from search.metrics import tensorboard_available
from supernet import Arch, SupernetError
from supernet.spaces import conv

ROOT = Path(__file__).resolve().parent.parent
TINY_CONV = ["space.layers=2", "space.channels=[4,8]", "space.downsample_at=[1]"]
CUSTOM = ["~space", "+space._target_=tests.custom_space.build"]
TINY = [
    "train.steps=12", "train.batch_size=32", "train.microbatches=2", "train.checkpoint_every=5",
    "train.log_every=4", "train.warmup_steps=2",
    "search.population=4", "search.generations=2", "search.top_k=3", "search.bn_calib_batches=1",
    "search.calib_batch_size=32", "threads=1",
]


def make_cfg(*overrides: str):
    """The tiny run config; a tiny conv space unless ``overrides`` bring their own space."""
    space = [] if overrides[:1] == ("~space",) else TINY_CONV
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*space, *TINY, *overrides])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # so that `tests.custom_space` imports


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny")
    return out, run(make_cfg(), output_dir=out)


def test_run_writes_metrics_summary_and_checkpoint(tiny_run: tuple[Path, dict]) -> None:
    out, summary = tiny_run
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.prev.pt", "checkpoint.pt", "metrics.csv", "metrics.jsonl", "search-evolution.jsonl", "summary.json",
        *(["tb"] if tensorboard_available() else [])]  # TensorBoard scalars (train.tensorboard=auto)
    assert json.loads((out / "summary.json").read_text()) == summary

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(12))
    for m in metrics:
        assert {"step", "arch", "loss", "samples_per_s", "lr", "migrated_ops", "migrated_bytes", "migration_s"} <= m.keys()
        assert set(m["arch"]) == {"layer00", "layer01"} and m["loss"] > 0 and m["samples_per_s"] > 0
    assert metrics[0]["lr"] < metrics[1]["lr"]  # warm-up, then cosine decay
    assert metrics[-1]["lr"] < metrics[2]["lr"]

    assert summary["steps"] == 12 and summary["world_size"] == 1 and summary["resumed_from_step"] == 0
    assert summary["final_loss"] == metrics[-1]["loss"]
    assert summary["mean_loss_last10"] == pytest.approx(sum(m["loss"] for m in metrics[-10:]) / 10)
    top = summary["top_k"]
    assert len(top) == 3 and summary["best"] == top[0]
    assert [t["val_accuracy"] for t in top] == sorted((t["val_accuracy"] for t in top), reverse=True)
    assert all(0 <= t["val_accuracy"] <= 1 and t["params"] > 0 and t["flops"] > 0 for t in top)
    assert summary["search"]["evaluated"] == 8 and len(summary["config_digest"]) == 64

    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt.step == 12 and ckpt.sampler["consumed"] == 12
    assert load_checkpoint(out / "checkpoint.prev.pt").step == 10  # the one before is kept
    log = [json.loads(line) for line in (out / "search-evolution.jsonl").read_text().splitlines()]
    assert [e["index"] for e in log] == list(range(8)) and [e["generation"] for e in log] == [0] * 4 + [1] * 4
    assert summary["search"]["best_per_generation"] == [max(e["val_accuracy"] for e in log[:4]),
                                                        max(e["val_accuracy"] for e in log)]
    assert summary["nonfinite_steps_skipped"] == 0 and not any(t["nonfinite"] for t in top)
    assert params_digest(ckpt.op_states) == summary["params_digest"]


def test_same_seed_same_params_digest(tiny_run: tuple[Path, dict], tmp_path: Path) -> None:
    out, first = tiny_run
    again = run(make_cfg(), output_dir=tmp_path / "again")
    assert again["params_digest"] == first["params_digest"]
    assert [m["loss"] for m in read_metrics(tmp_path / "again")] == [m["loss"] for m in read_metrics(out)]
    assert again["top_k"] == first["top_k"]
    other = run(make_cfg("seed=1"), output_dir=tmp_path / "other")
    assert other["params_digest"] != first["params_digest"]


def crash_at(monkeypatch: pytest.MonkeyPatch, at: int):
    """Make the one-process engine raise ("node lost") at step ``at``; returns the real step."""
    real_step = pipeline.reference.ReferenceEngine.train_step

    def crashing(self, step, arch, x, y):
        if step == at:
            raise RuntimeError("node lost")
        return real_step(self, step, arch, x, y)

    monkeypatch.setattr(pipeline.reference.ReferenceEngine, "train_step", crashing)
    return real_step


def test_resume_after_a_crash_equals_an_uninterrupted_run(tiny_run: tuple[Path, dict], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out, uninterrupted = tiny_run
    real_step = crash_at(monkeypatch, 7)
    with pytest.raises(RuntimeError, match="node lost"):
        run(make_cfg(), output_dir=tmp_path)
    assert load_checkpoint(tmp_path / "checkpoint.pt").step == 5  # checkpoint_every=5
    assert len(read_metrics(tmp_path)) == 7 and not (tmp_path / "summary.json").exists()

    monkeypatch.setattr(pipeline.reference.ReferenceEngine, "train_step", real_step)
    resumed = run(make_cfg(), output_dir=tmp_path)
    assert resumed["resumed_from_step"] == 5
    assert resumed["params_digest"] == uninterrupted["params_digest"]
    assert read_metrics(tmp_path) == [
        {**m, "samples_per_s": r["samples_per_s"], "seconds": r["seconds"]}
        for m, r in zip(read_metrics(out), read_metrics(tmp_path))
    ]  # the same steps, archs, losses and lrs; only timings differ
    assert resumed["final_loss"] == uninterrupted["final_loss"]
    assert resumed["mean_loss_last10"] == uninterrupted["mean_loss_last10"]
    assert resumed["top_k"] == uninterrupted["top_k"]

    # a finished run found again only searches, with the same result
    again = run(make_cfg("search=random"), output_dir=tmp_path)
    assert again["resumed_from_step"] == 12 and again["params_digest"] == uninterrupted["params_digest"]
    assert len(read_metrics(tmp_path)) == 12


def test_checkpoint_of_another_training_config_is_refused(tiny_run: tuple[Path, dict]) -> None:
    out, _ = tiny_run
    def files() -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    before = files()
    with pytest.raises(CheckpointError, match="written by a run with other training settings"):
        run(make_cfg("train.optimizer.lr=0.2"), output_dir=out)
    assert files() == before


def test_random_search_with_constraints(tmp_path: Path) -> None:
    graph = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])
    cost = SubnetCost(graph, (1, 8, 8))
    limit = cost.params(Arch({"layer00": "k3e3", "layer01": "k5e3"}))
    summary = run(make_cfg("search=random", "sampler=fair", f"search.constraints.max_params={limit}",
                           "search.population=3"), output_dir=tmp_path)
    assert summary["search"]["algorithm"] == "random" and summary["search"]["evaluated"] == 6
    assert all(t["params"] <= limit for t in summary["top_k"])


def test_custom_space_end_to_end(tmp_path: Path) -> None:
    summary = run(make_cfg(*CUSTOM, "+space.layers=3"),
                  output_dir=tmp_path)
    assert set(summary["best"]["arch"]) == {"l0", "l1", "l2"}


SEED_ARCH_UNKNOWN_LABEL = "search.seed_archs=[{layer00:k3e3,layer01:k3e3,layer99:skip}]"
SEED_ARCH_OUTSIDE = "search.seed_archs=[{layer00:k7e3,layer01:k3e3}]"


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ([*CUSTOM, "+space.op=no_such_op"], ConfigError,
     "space (tests.custom_space.build): op 'l0/relu': unknown op kind 'no_such_op'"),
    ([SEED_ARCH_UNKNOWN_LABEL], SupernetError, "search.seed_archs[0].layer99: unknown label"),
    ([SEED_ARCH_OUTSIDE], SupernetError,
     "search.seed_archs[0].layer00: expected one of ['k3e3', 'k3e6', 'k5e3', 'k5e6', 'skip'], found 'k7e3'"),
    (["space._target_=supernet.spaces.mlp.build"], ConfigError,
     "space._target_: cannot import 'supernet.spaces.mlp.build'"),
    (["train.microbatches=3"], ConfigError, "train.microbatches: expected a divisor of train.batch_size (32), found 3"),
    (["train.optimizer.name=lamb"], ConfigError, "train.optimizer.name: expected one of ['sgd', 'adamw'], found 'lamb'"),
    (["train.batch_size=4096", "train.microbatches=1"], ValueError, "train.batch_size: expected an integer between 1 and 1437"),
])
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path: Path, overrides: list[str], error: type,
                                                    message: str) -> None:
    out = tmp_path / "run"
    with pytest.raises(error) as e:
        run(make_cfg(*overrides), output_dir=out)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_torchrun_pins_one_run_dir_per_override_set() -> None:
    argv = ["search", "train.steps=5", "seed=2"]
    assert torchrun_argv(argv, {}) == argv  # one process: untouched
    rank0 = torchrun_argv(argv, {"WORLD_SIZE": "2", "RANK": "0"})
    rank1 = torchrun_argv(argv, {"WORLD_SIZE": "2", "RANK": "1"})
    pinned = rank0[-1]
    assert pinned.startswith("hydra.run.dir=outputs/torchrun/") and len(pinned.split("/")[-1]) == 12
    assert rank1[:4] == rank0 and rank1[4:] == ["hydra.output_subdir=null", "hydra/job_logging=rank_stderr"]
    assert torchrun_argv(["search", "seed=2", "train.steps=5"], {"WORLD_SIZE": "2"})[-1] == pinned  # order-free
    assert torchrun_argv(["search", "seed=3"], {"WORLD_SIZE": "2"})[-1] != pinned
    mine = torchrun_argv(["search", "hydra.run.dir=/x"], {"WORLD_SIZE": "2", "RANK": "0"})
    assert mine == ["search", "hydra.run.dir=/x"]
