#!/usr/bin/env bash
# The second GPU session's checks (about 7 minutes): what the first left unmeasured.
# PortableAdamW against torch's AdamW (bench/optim_step.py), the split backward on the GPU
# (bench/split_backward.py), the tensor manager's AdamW rows again with PortableAdamW
# (bench/vtm_cpu.py), and what deterministic kernels cost a real run (bench/deterministic_ab.sh: the app, torch's
# deterministic mode with and without its fill of new memory, and off; two rounds) and where
# (bench/deterministic_profile.py).
#
#   bash bench/device_check2.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 60 python3 bench/optim_step.py --device cuda 2>&1 | tee "$out/optim_step.jsonl"
timeout 30 python3 bench/optim_step.py --device cpu --repeats 20 2>&1 | tee -a "$out/optim_step.jsonl"
timeout 100 python3 bench/split_backward.py --device cuda --batch 128 2>&1 | tee "$out/split_backward.jsonl"
timeout 120 python3 bench/vtm_cpu.py --device cuda --rounds 2 --setting transformer --optimizer hybrid 2>&1 \
  | grep '^{' | tee "$out/vtm_cuda_hybrid.jsonl"
timeout 60 python3 bench/deterministic_profile.py 2>&1 | grep '^{' | tee "$out/deterministic_profile.jsonl"
OUT="$out" timeout 330 bash bench/deterministic_ab.sh
