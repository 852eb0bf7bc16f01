#!/usr/bin/env bash
# The seventh GPU session's checks (about 7 minutes; the CUDA tests alone took 130 s on the H100 on
# 2026-11-27): what changed since the sixth.
# - the CUDA-only tests again (clipping's sums now torch.linalg.vector_norm in float64, the scaling one
#   torch._foreach_mul; the executor's norm messages; byte caps under a budget).
# - bench/cuda_compose.py: clipping inside a cross-subnet schedule (window 4, delayed) under a budget, with
#   the default hybrid placement, host updates and swapped activations, on conv, the transformer and resmlp,
#   each against the all-resident clipped run: a GPU's float64 sums must not depend on where the weights live.
# - tests/test_clipping.py (the CPU multi-process tests: clipped window-4 / ZB-H1 layouts against one
#   process) on this machine's Python and torch.
#
#   bash bench/device_check7.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 230 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  tests/test_activation_policy.py tests/test_eager.py -k "cuda or eager" 2>&1 | tee "$out/cuda_tests.log" | tail -5
timeout 170 python3 bench/cuda_compose.py --device cuda --jobs 12 --spaces conv transformer resmlp \
  --variants "train.clip_grad_norm=0.5" "train.clip_grad_norm=0.5 memory.optimizer=host" \
  "train.clip_grad_norm=0.5 memory.activations=swap" 2>&1 | tee "$out/cuda_compose.jsonl" | cut -c1-230
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_clipping.py 2>&1 | tee "$out/clipping.log" | tail -4
