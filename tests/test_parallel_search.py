"""Scoring on every process (search/parallel.py): the choice of scoring, the config switch, and
torchrun N = 2 against one process on the same machine: the same archs, scores and best arch.

The torchrun runs share one tiny supernet: trained and searched by evolution with parallel
scoring (5 archs per generation: shares of 3 and 2), then, each in a copy of that run directory
(search only), a random search of 20 archs (two gathers: 16 + 4), the same evolution scored the
pipelined way (``search.parallel=false``), and a rank that fails while scoring (no hang: its
peer names it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from search.app import run
from search.config import ConfigError, load_config
from search.parallel import ARCHS_PER_RANK, choose
from tests.cli_driver import child_env, torchrun_search
from tests.test_app import TINY, TINY_CONV, make_cfg

EVOLUTION = ["search.population=5", "search.generations=2"]
RANDOM = ["search=random", "search.population=10", "search.generations=2"]


def test_choose_parallel_scoring_by_setting_world_budget_and_archs() -> None:
    assert choose("auto", 1, False, 96).parallel is False  # one process: the engine is the one-process engine
    assert choose(True, 1, False, 96).parallel is False
    assert choose("auto", 2, False, 96).parallel is True
    off = choose(False, 2, False, 96)
    assert off.parallel is False and off.reason == "search.parallel=false"
    budget = choose("auto", 4, True, 96)
    assert budget.parallel is False and "device budget" in budget.reason and "search.parallel=true" in budget.reason
    assert choose(True, 4, True, 96).parallel is True  # asked for: each rank within the budget
    assert choose("auto", 2, False, 1).parallel is False  # search=none: the one fixed arch
    assert ARCHS_PER_RANK >= 1


def test_search_parallel_config_values() -> None:
    assert load_config(make_cfg()).search.parallel == "auto"
    assert load_config(make_cfg("search.parallel=true")).search.parallel is True
    assert load_config(make_cfg("search.parallel=false")).search.parallel is False
    for bad, found in (("yes", "'yes'"), ("1", "1")):
        with pytest.raises(ConfigError) as e:
            load_config(make_cfg(f"search.parallel={bad}"))
        assert str(e.value) == (f"search.parallel: expected auto, true or false (under torchrun: score each batch of "
                                f"archs on every process), found {found}")


def same_search(summary: dict[str, Any]) -> dict[str, Any]:
    """What a search decided, without its timing: best, top_k, search, every search section."""
    searches = {alg: {k: v for k, v in sec.items() if k != "search_time_s"} for alg, sec in summary["searches"].items()}
    return {"best": summary["best"], "top_k": summary["top_k"], "search": summary["search"], "searches": searches,
            "params_digest": summary["params_digest"]}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process: evolution after training, then a random search of the same weights (resumed)."""
    out = tmp_path_factory.mktemp("one")
    evolution = run(make_cfg(*EVOLUTION), output_dir=out)
    evolution_log = (out / "search-evolution.jsonl").read_text()
    rand = run(make_cfg(*RANDOM), output_dir=out)
    return {"evolution": evolution, "evolution_log": evolution_log, "random": rand,
            "random_log": (out / "search-random.jsonl").read_text()}


@pytest.mark.dist
def test_torchrun_scores_on_every_process_as_one_process(one_process: dict[str, Any], tmp_path: Path) -> None:
    common = [*TINY_CONV, *TINY, "pipeline.timeout_s=30", "pipeline.stages=2"]  # (the pipelined scoring: two stages)
    first = torchrun_search([*common, *EVOLUTION, f"hydra.run.dir={tmp_path / 'par'}"], tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "search: scoring on every process (search.parallel=auto): 2 ranks" in first.stdout + first.stderr
    summary = json.loads((tmp_path / "par" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["search"]["evaluated"] == 10
    assert same_search(summary) == same_search(one_process["evolution"])
    assert (tmp_path / "par" / "search-evolution.jsonl").read_text() == one_process["evolution_log"]
    for name in ("pipelined", "failing"):  # search-only reruns of the same weights
        shutil.copytree(tmp_path / "par", tmp_path / name)

    rand = torchrun_search([*common, *RANDOM, f"hydra.run.dir={tmp_path / 'par'}"], tmp_path)
    assert rand.returncode == 0, rand.stderr[-4000:]
    summary = json.loads((tmp_path / "par" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 12 and summary["search"]["evaluated"] == 20 > 2 * ARCHS_PER_RANK
    assert same_search(summary) == same_search(one_process["random"])  # both searches' sections too
    assert (tmp_path / "par" / "search-random.jsonl").read_text() == one_process["random_log"]

    piped = torchrun_search([*common, *EVOLUTION, "search.parallel=false", f"hydra.run.dir={tmp_path / 'pipelined'}"],
                            tmp_path)
    assert piped.returncode == 0, piped.stderr[-4000:]
    assert ("search: pipelined scoring, one arch at a time over all stages (search.parallel=false)"
            in piped.stdout + piped.stderr)
    assert (tmp_path / "pipelined" / "search-evolution.jsonl").read_text() == one_process["evolution_log"]

    # rank 1 fails before its share of archs 0..4 (arch 2 is rank 0's): rank 0 names it, nothing hangs
    failed = torchrun_search([*common, *EVOLUTION, f"hydra.run.dir={tmp_path / 'failing'}"], tmp_path,
                             env=child_env(PIPENAS_FAULT="1:2:evaluate:raise"), timeout_s=120)
    assert failed.returncode != 0
    assert "rank 1 (stage 1) failed at step -1 during evaluate: RuntimeError: injected fault (PIPENAS_FAULT) at " \
           "rank 1, step 2, action evaluate" in failed.stdout + failed.stderr, failed.stderr[-4000:]
    assert "root cause: rank 1 failed at step -1 during evaluate" in failed.stdout + failed.stderr  # rank 0 quotes it
