"""Deterministic kernels on CUDA: the same bits from every run, as on the CPU.

On the CPU torch's kernels give the same bits run after run; on CUDA some do not by default
(cuDNN picks convolution algorithms by timing them and some of its backward kernels, and some
cuBLAS paths, sum with atomics in whatever order the threads arrive), so two runs of the same
config, and a run with the tensor manager against one all-resident, would differ in their last
bits. :func:`use_deterministic_kernels` asks torch for its deterministic kernels: the
bit-identity that the tests prove on the CPU then holds on the GPU too (``bench/device_check.sh``).
An op with no deterministic CUDA kernel warns instead of stopping the run.

Deterministic mode in torch also fills every new uninitialized tensor (``torch.empty``) with NaN,
a kernel per allocation, to expose reads of uninitialized memory; no op of ours reads memory it
did not write, and the fill was about 5 % of the transformer's training time on an H200
(``bench/deterministic_ab.sh``; the same bits without it), so it stays off
(``FILL_UNINITIALIZED_MEMORY``). Deterministic mode itself still costs that run 1.37x, on the
host side of torch's matrix products (``bench/deterministic_profile.py``): ``deterministic=false``
for speed where repeatable bits do not matter.

torch's ``use_deterministic_algorithms`` also sets the compiler's flag, importing
``torch._inductor.config`` and with it ``torch._dynamo`` (1.5-2 s of a rank's start, seen on an
H100 with torch 2.11), which an eager process otherwise skips (:mod:`pipeline.eager`). Where the
process skips it, only the kernels' switch is set (torch's ``_C._set_deterministic_algorithms``,
what the public call sets besides the compiler's flag); a process that compiles
(``PIPENAS_KEEP_DYNAMO=1``, or the compiler already imported) gets the public call.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.utils.deterministic

__all__ = ["use_deterministic_kernels"]

# cuBLAS's deterministic workspace (torch raises without it once deterministic algorithms are on);
# read when the process makes its first cuBLAS handle, so it is set before any CUDA work.
CUBLAS_WORKSPACE = ":4096:8"
FILL_UNINITIALIZED_MEMORY = False  # torch's default under deterministic mode is True (see above)


def use_deterministic_kernels(device: str, on: bool = True) -> None:
    """For a CUDA ``device``: deterministic kernels when ``on`` (the config's ``deterministic``),
    torch's defaults otherwise. Nothing to do on the CPU."""
    if not str(device).startswith("cuda"):
        return
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    _set_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = on and FILL_UNINITIALIZED_MEMORY
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = on


def _set_deterministic_algorithms(on: bool) -> None:
    """torch's deterministic-algorithms switch (warn only), without importing its compiler where
    this process does not compile (the module doc)."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    compiles = os.environ.get("PIPENAS_KEEP_DYNAMO") == "1" or "torch._inductor" in sys.modules
    if setter is None or compiles:
        torch.use_deterministic_algorithms(on, warn_only=True)
    else:
        setter(on, warn_only=True)
