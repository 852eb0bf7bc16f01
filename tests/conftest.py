"""Fixtures shared by every test: one CPU thread and seeded global RNGs, so runs repeat exactly."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.determinism import use_deterministic_kernels

if torch.cuda.is_available():  # the same bits run after run on the GPU too, as the app's runs get
    use_deterministic_kernels("cuda")


@pytest.fixture(autouse=True)
def deterministic() -> None:
    """Single-threaded torch and seeded global RNGs (code under test must not rely on them,
    but a test that draws its data from them repeats exactly)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


# The files that take longest (one to nine minutes each on 2 cores; measured 2026-11-28 with
# --junitxml) are collected first: pytest-xdist hands out whole files (--dist loadfile) in collection
# order, and one of these started last ran alone at the end of the suite. The rest keep pytest's order.
LONGEST_FIRST = ("test_readme.py", "test_memory_pipeline.py", "test_cli.py", "test_data_parallel.py",
                 "test_pipeline_equivalence.py", "test_composition.py", "test_peer.py", "test_parallel_search.py",
                 "test_clipping.py", "test_memory_precheck.py", "test_delayed_oracle.py", "test_cross_pipeline.py")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist 3.7+ hands out files by their number of tests, most first, unless told not to:
    # that put the files of few long multi-process tests last. Keep the order below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
