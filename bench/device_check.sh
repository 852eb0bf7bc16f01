#!/usr/bin/env bash
# The device checks, ready for the day a GPU is lent (one short script, about 5 minutes):
# the CUDA-only tests (the copier with real streams and events, the budgeted store bit-identical
# to all-resident on the GPU, CUDA synchronisation, the README's CUDA command), the copy
# engine's streams, where a CUDA run's bits come from (bench/cuda_bits.py), the split backward's
# cost (bench/split_backward.py), and the tensor manager on real runs (budget against all-resident on the GPU).
# Figures go to $OUT (or bench/out) as JSON lines; paste them into bench/RESULTS.md with the date
# and the device.
#
#   bash bench/device_check.sh            # on the GPU machine, from the repository root
#
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  -k "cuda" 2>&1 | tee "$out/cuda_tests.log" | tail -15
timeout 150 python3 bench/cuda_bits.py 2>&1 | tee "$out/cuda_bits.jsonl"
timeout 120 python3 bench/split_backward.py --device cuda --batch 128 2>&1 | tee "$out/split_backward.jsonl"
timeout 60 python3 bench/copy_streams.py --ops 16 --mb 64 --repeats 5 2>&1 | tee "$out/copy_streams.jsonl"
timeout "${VTM_TIMEOUT:-150}" python3 bench/vtm_cpu.py --device cuda --rounds 2 2>&1 | grep '^{' | tee "$out/vtm_cuda.jsonl"
