"""Deterministic kernels on CUDA: the same bits from every run, as on the CPU.

On the CPU torch's kernels give the same bits run after run; on CUDA some do not by default
(cuDNN picks convolution algorithms by timing them and some of its backward kernels, and some
cuBLAS paths, sum with atomics in whatever order the threads arrive), so two runs of the same
config, and a run with the tensor manager against one all-resident, would differ in their last
bits. :func:`use_deterministic_kernels` asks torch for its deterministic kernels: the
bit-identity that the tests prove on the CPU then holds on the GPU too (``bench/device_check.sh``).
An op with no deterministic CUDA kernel warns instead of stopping the run.
"""
from __future__ import annotations

import os

import torch

__all__ = ["use_deterministic_kernels"]

# cuBLAS's deterministic workspace (torch raises without it once deterministic algorithms are on);
# read when the process makes its first cuBLAS handle, so it is set before any CUDA work.
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_kernels(device: str, on: bool = True) -> None:
    """For a CUDA ``device``: deterministic kernels when ``on`` (the config's ``deterministic``),
    torch's defaults otherwise. Nothing to do on the CPU."""
    if not str(device).startswith("cuda"):
        return
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = on
