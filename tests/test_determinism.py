"""Deterministic kernels: asked for on CUDA devices only, and undone when the config says false."""
from __future__ import annotations

import os

import pytest
import torch

from pipeline.determinism import CUBLAS_WORKSPACE, use_deterministic_kernels


@pytest.fixture
def restore():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2], before[3]
    if before[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[4]


def test_the_cpu_is_left_alone(restore) -> None:
    torch.use_deterministic_algorithms(False)
    use_deterministic_kernels("cpu")
    use_deterministic_kernels(torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_a_cuda_device_gets_deterministic_kernels_and_false_undoes_them(device, restore) -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.backends.cudnn.benchmark = True
    use_deterministic_kernels(device)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    use_deterministic_kernels(device, on=False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
