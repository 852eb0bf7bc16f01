#!/usr/bin/env bash
# The eighth GPU session's checks (about 8 minutes): what the tensor manager costs a real
# cross-subnet run on one GPU, by optimizer placement (issue 22; the simulator says the default
# `hybrid` without memory.host_update_rate is slower than `device` when the host's optimizer is slow).
# - the CUDA-only tests of the tensor manager (tests/test_memory.py -k cuda).
# - bench/cuda_placements.py: NASPipe's space cut to 8 layers at width 1024 (2 GiB of op state with
#   AdamW), window 4, delayed, 4x and 8x over-subscription, `device` / `hybrid` / `host` against
#   all-resident, two rounds; each run's weights against all-resident's.
#
#   bash bench/device_check8.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/test_memory.py -k cuda 2>&1 | tee "$out/cuda_tests.log" | tail -3
timeout 420 python3 bench/cuda_placements.py --device cuda --layers 8 --width 1024 --steps 30 --rounds 2 \
  2>&1 | tee "$out/cuda_placements.jsonl" | cut -c1-330
