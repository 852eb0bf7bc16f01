"""The run's (stages, replicas) layout (pipeline/layout.py): every small world and setting, and
the command line's one-line errors for layouts that cannot run (checked before anything is
written, on every rank alike; the torchrun runs themselves are in tests/test_readme.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import MemorySettings, PipelineSettings
from pipeline.layout import Layout, LayoutError, resolve_layout
from supernet.spaces import conv
from tests.cli_driver import Case, run_cases
from tests.test_app import TINY, TINY_CONV

GRAPH = conv.build(input_shape=(1, 8, 8), num_classes=10, layers=2, channels=[4, 8], downsample_at=[1])
BUDGET = MemorySettings(device_budget_bytes=10**6)


def _layout(stages, world, micro, shared="exact", memory=None) -> Layout:
    return resolve_layout(PipelineSettings(stages=stages, shared_ops=shared), memory, world, micro, GRAPH, "sgd",
                          (1, 8, 8), 64)


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_every_fixed_layout(world: int, micro: int) -> None:
    for stages in [None, *range(1, 10)]:
        if world == 1:
            if stages in (None, 1):
                assert _layout(stages, world, micro) == Layout(1, 1)
            else:
                with pytest.raises(LayoutError, match=rf"torchrun --nproc_per_node={stages} -m search"):
                    _layout(stages, world, micro)
            continue
        s = world if stages is None else stages
        if world % s:
            with pytest.raises(LayoutError, match=rf"pipeline.stages: expected a divisor of the number of "
                                                  rf"processes {world} .* found {s}$"):
                _layout(stages, world, micro)
        elif micro % (world // s):
            with pytest.raises(LayoutError, match=rf"train.microbatches: expected a multiple of the replica count "
                                                  rf"{world // s} .*found {micro}$"):
                _layout(stages, world, micro)
        else:
            assert _layout(stages, world, micro) == Layout(s, world // s)
            for shared, memory in (("delayed", None), ("frozen", None), ("exact", BUDGET), ("delayed", BUDGET)):
                # replicas combine with every shared-op mode and a budget (pipeline/combinations.py)
                assert _layout(stages, world, micro, shared, memory) == Layout(s, world // s)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_auto_picks_a_layout_the_settings_allow(world: int) -> None:
    free = _layout("auto", world, 4)
    assert free.stages * free.replicas == world and 4 % free.replicas == 0
    assert _layout("auto", world, 4, "delayed") == free  # shared ops combine with replicas: the same pick
    # a memory budget: one stage per process (stages split a subnet's memory, replicas copy it)
    assert _layout("auto", world, 4, "exact", BUDGET) == Layout(world, 1)


def test_layout_errors_from_the_command_line_write_nothing(tmp_path: Path) -> None:
    """The check runs in ``prepare`` on every rank before Hydra writes: a rank that sees a
    torchrun world (RANK, WORLD_SIZE) rejects a layout that cannot run with one line, status 2."""
    cases = {
        "one process, 2 stages": (["pipeline.stages=2"], None, "pipeline.stages: expected the number of processes"),
        "3 processes, 2 stages": (["pipeline.stages=2"], "3", "pipeline.stages: expected a divisor of the number of "
                                                              "processes 3 (processes = stages x replicas: one of "
                                                              "[1, 3]), 'auto' or null, found 2"),
        "4 processes, 1 stage, 2 micro-batches": (["pipeline.stages=1", "train.microbatches=2"], "4",
                                                  "train.microbatches: expected a multiple of the replica count 4"),
        "clipping with dc compensation in a pipeline": (
            ["pipeline.shared_ops=delayed", "pipeline.delay_compensation=dc", "train.clip_grad_norm=1"], "2",
            "train.clip_grad_norm / pipeline.delay_compensation: found delay_compensation 'dc' with clipping in a "
            "pipeline"),
    }
    run = [Case([*TINY_CONV, *TINY, *args, f"hydra.run.dir={tmp_path}/rejected"], str(tmp_path),
                 {"RANK": "0", "WORLD_SIZE": world} if world else {}) for args, world, _ in cases.values()]
    for (name, (_, _, message)), r in zip(cases.items(), run_cases(run)):
        assert r.status == 2, f"{name}: {r.stderr}"
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], f"{name}: {r.stderr}"
    assert not (tmp_path / "rejected").exists()
