#!/usr/bin/env bash
# The device checks, ready for the day a GPU is lent (one short script; ~5 min on an H100):
# the CUDA-only tests (the copier with real streams and events, the budgeted store bit-identical
# to all-resident on the GPU, CUDA synchronisation, the README's CUDA command), then the copy
# engine's streams. Figures go to $OUT (or bench/out) as JSON lines; paste them into
# bench/RESULTS.md with the date and the device.
#
#   bash bench/device_check.sh            # on the GPU machine, from the repository root
set -u
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, networkx, hydra" 2>/dev/null || python3 -m pip install -q -e '.[test]'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py -k "cuda" 2>&1 \
  | tee "$out/cuda_tests.log" | tail -15
python3 -m pytest -q -p no:cacheprovider -rs tests/test_readme.py -k "cuda" 2>&1 | tee -a "$out/cuda_tests.log" | tail -5
python3 bench/copy_streams.py --ops 16 --mb 64 --repeats 5 2>&1 | tee "$out/copy_streams.jsonl"
