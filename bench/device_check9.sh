#!/usr/bin/env bash
# The next GPU session's checks (about 8 minutes on an H100): the host-update threads against the
# `device` placement on the same machine, with per-step times (the eighth session measured hybrid on
# threads at 0.80x of all-resident's steady step and `device` at 0.87x, on two machines, and saw
# ~5 s of early-step cost in the threaded run that it could not break down; a guess: the pinned
# gradient buffers that several steps' host updates hold at once are new cudaHostAlloc blocks).
# - the CUDA-only tests of the tensor manager. Since 2026-11-28 the gradients of ops updated at home go
#   home on the write-back stream (not a synchronous copy per parameter): the first device run of that.
# - bench/cuda_placements.py: all-resident, device, hybrid (threads), hybrid threads=0 at 4x, two
#   rounds of 40 steps; the JSON lines carry each run's per-step seconds (steps_s).
#
#   bash bench/device_check9.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/test_memory.py -k "cuda or beside_training or gradients_copied_home or square_root or formula_bit" 2>&1 | tee "$out/cuda_tests.log" | tail -3
# the host's optimizer rate on this machine's cores (PortableAdamW: a CUDA run's host updates), the
# figure the simulator assumes per stage (1.5 G parameters a second) and memory.host_update_rate: auto measures
timeout 45 python3 bench/host_rate.py --threads 0 1 4 8 15 --rounds 3 2>&1 | tee "$out/host_rate.jsonl"
timeout 400 python3 bench/cuda_placements.py --device cuda --layers 8 --width 1024 --steps 40 --rounds 2 --over 4 \
  --placements device hybrid "hybrid memory.host_update_threads=0" 2>&1 | tee "$out/cuda_placements.jsonl" | cut -c1-330
