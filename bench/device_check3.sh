#!/usr/bin/env bash
# The third GPU session's checks (about 6 minutes): what changed since the second, and what it left.
# - bench/cuda_compose.py: issue 22's combinations (window 1/4, exact/delayed/frozen, each optimizer
#   placement, activation mode and policy) under a budget against all-resident, one process on the GPU.
# - the CUDA-only tests again (38 commits since the last GPU run).
# - bench/optim_step.py: torch's fused CUDA AdamW and foreach=True beside foreach=False and
#   PortableAdamW (time and bits: could CUDA runs use the fused kernel, as the CPU's do?).
# - bench/layouts.py on the GPU machine's CPU cores (CUDA hidden): issue 23's layouts where two
#   processes do not share two cores with their helper threads.
#
#   bash bench/device_check3.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 170 python3 bench/cuda_compose.py --device cuda --jobs 8 2>&1 | tee "$out/cuda_compose.jsonl" | cut -c1-160
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  -k "cuda" 2>&1 | tee "$out/cuda_tests.log" | tail -6
timeout 60 python3 bench/optim_step.py --device cuda 2>&1 | tee "$out/optim_step.jsonl"
CUDA_VISIBLE_DEVICES= timeout 170 python3 bench/layouts.py --rounds 1 --spaces transformer default \
  --layouts one_process stages1 auto --name layouts_host 2>&1 | grep '^{' | tee "$out/layouts_host.jsonl" | cut -c1-200
