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
