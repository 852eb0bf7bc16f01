#!/usr/bin/env bash
# The fifth GPU session's checks (about 8 minutes): what changed since the fourth, and what it left.
# - the CUDA-only tests again (optimizer steps now go through pipeline.eager.step; the start-up work).
# - bench/cuda_compose.py: the window-4 delayed variants (optimizer device / host, activations swap /
#   recompute, the lru policy) on conv and the transformer, which the fourth session did not reach.
# - bench/layouts.py on the machine's CPU cores (CUDA hidden), two rounds with the two-process
#   ceiling beside them (the fourth session's cores were busy with something else).
#
#   bash bench/device_check5.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  tests/test_activation_policy.py tests/test_eager.py -k "cuda or eager" 2>&1 | tee "$out/cuda_tests.log" | tail -6
timeout 200 python3 bench/cuda_compose.py --device cuda --jobs 10 --spaces conv transformer \
  --variants memory.optimizer=device memory.optimizer=host memory.activations=swap memory.activations=recompute \
  memory.policy=lru 2>&1 | tee "$out/cuda_compose.jsonl" | cut -c1-170
nproc_probe() { python3 - <<'PY'
import os, time, multiprocessing as mp
def spin(_):
    t = time.perf_counter(); x = 0
    for i in range(3_000_000): x += i
    return time.perf_counter() - t
with mp.Pool(2) as p:
    t = time.perf_counter(); p.map(spin, [0, 1]); two = time.perf_counter() - t
t = time.perf_counter(); spin(0); one = time.perf_counter() - t
print({"probe_two_over_one": round(two / one, 2), "loadavg": os.getloadavg()})
PY
}
nproc_probe | tee "$out/probe.txt"
CUDA_VISIBLE_DEVICES= timeout 170 python3 bench/layouts.py --rounds 2 --spaces transformer \
  --layouts one_process stages1 auto two_halves --name layouts_host 2>&1 | grep '^{' | tee "$out/layouts_host.jsonl" | cut -c1-220
nproc_probe | tee -a "$out/probe.txt"
