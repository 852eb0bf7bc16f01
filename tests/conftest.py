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


# File order under `-n auto --dist loadfile`: pytest-xdist (3.7+) hands out whole files by their number of
# tests, most first, which interleaves the files of a few long multi-process tests with files of many
# short ones. A longest-first order (tried 2026-11-28) ran the multi-process files side by side on both
# workers, oversubscribing 2 cores: the suite took 17:44, against 17:13 in xdist's order with 140 s more
# test work (one run each on a fresh clone). So xdist's order stands.
