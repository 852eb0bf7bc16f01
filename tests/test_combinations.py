"""The one table of what does not combine (pipeline/combinations.py): each row raises one line
naming its fields, nothing else is refused, and the README shows the table as it is."""
from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from pipeline import PipelineSettings
from pipeline.combinations import LIMITS, CombinationError, check, limits_table
from pipeline.memory import MemorySettings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_window_mode_budget_combination_passes_without_clipping() -> None:
    for window, shared, budget in itertools.product((1, 4), ("exact", "delayed", "frozen"), (None, 10**6)):
        check(PipelineSettings(window=window, shared_ops=shared), MemorySettings(device_budget_bytes=budget))


@pytest.mark.parametrize("window,shared", [(4, "exact"), (1, "delayed"), (1, "frozen")])
def test_clipping_combines_with_cross_subnet_schedules_and_replicas(window: int, shared: str) -> None:
    settings = PipelineSettings(window=window, shared_ops=shared)
    for world, stages in ((1, None), (2, None), (4, None), (4, "auto"), (4, 2), (4, 1)):
        check(dataclasses.replace(settings, stages=stages), None, clip_grad_norm=1.0, world_size=world)


def test_dc_compensation_with_clipping_in_a_pipeline_is_one_line() -> None:
    dc = PipelineSettings(shared_ops="delayed", delay_compensation="dc")
    check(dc, None, clip_grad_norm=1.0)  # one process: the reference clips after the rule
    with pytest.raises(CombinationError, match=r"^train.clip_grad_norm / pipeline.delay_compensation: found"):
        check(dc, None, clip_grad_norm=1.0, world_size=2)
    check(dataclasses.replace(dc, delay_compensation="predict"), None, clip_grad_norm=1.0, world_size=2)


def test_a_pipeline_budget_beside_the_managers_is_one_line() -> None:
    with pytest.raises(CombinationError, match=r"^pipeline.memory_budget_bytes / memory.device_budget_bytes: found"):
        check(PipelineSettings(memory_budget_bytes=1e6), MemorySettings(device_budget_bytes=10**6))


def test_the_readme_shows_the_table() -> None:
    text = README.read_text()
    block = re.search(r"<!-- combinations:[^\n]*-->\n(.*?)\n<!-- end combinations -->", text, re.S)
    assert block is not None and block.group(1) == limits_table(), "regenerate the README's table"
    assert len(LIMITS) == limits_table().count("\n") - 1


def test_byte_caps_with_a_split_or_activation_budget_are_one_line() -> None:
    for pipe, memory, what in (
            (PipelineSettings(inflight="bytes", memory_budget_bytes=1e6), None, "pipeline.memory_budget_bytes"),
            (PipelineSettings(inflight="bytes", window=4),
             MemorySettings(device_budget_bytes=10**6, activations="auto", activation_budget_bytes=10**5),
             "memory.activation_budget_bytes")):
        with pytest.raises(CombinationError, match=r"^pipeline.inflight / pipeline.memory_budget_bytes, memory.activa"):
            check(pipe, memory)
        with pytest.raises(CombinationError, match=f"found inflight 'bytes' with {what}"):
            check(pipe, memory)
    check(PipelineSettings(inflight="bytes", window=4), MemorySettings())  # all resident: combines
    for activations in ("keep", "swap", "recompute", "auto"):  # a tensor-manager budget bounds the weights: combines
        check(PipelineSettings(inflight="bytes", window=4),
              MemorySettings(device_budget_bytes=10**6, activations=activations))
    with pytest.raises(ValueError, match="pipeline.inflight: expected 'count' or 'bytes', found 'pages'"):
        PipelineSettings(inflight="pages")
