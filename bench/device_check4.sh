#!/usr/bin/env bash
# The fourth GPU session's checks (about 6 minutes): what changed since the third, and issue 23's
# ceiling on a machine with cores to spare.
# - the CUDA-only tests again (the commits since the third GPU run: shared_delays, the data cache).
# - bench/layouts.py on the GPU machine's CPU cores (CUDA hidden), with two_halves: two one-process
#   runs at once, the ceiling of two processes, beside data parallel and auto, two rounds on the
#   transformer w256 l8, one on the default space (is data parallel's gap to that ceiling the
#   2-core VM's, or ours?).
# - bench/cuda_compose.py: issue 22's combinations under a budget against all-resident on the GPU.
#
#   bash bench/device_check4.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  tests/test_activation_policy.py -k "cuda" 2>&1 | tee "$out/cuda_tests.log" | tail -6
CUDA_VISIBLE_DEVICES= timeout 150 python3 bench/layouts.py --rounds 2 --spaces transformer \
  --layouts one_process stages1 auto two_halves --name layouts_host 2>&1 | grep '^{' | tee "$out/layouts_host.jsonl" | cut -c1-220
CUDA_VISIBLE_DEVICES= timeout 80 python3 bench/layouts.py --rounds 1 --spaces default \
  --layouts one_process stages1 auto two_halves --name layouts_host_default 2>&1 | grep '^{' \
  | tee "$out/layouts_host_default.jsonl" | cut -c1-220
timeout 140 python3 bench/cuda_compose.py --device cuda --jobs 8 2>&1 | tee "$out/cuda_compose.jsonl" | cut -c1-160
