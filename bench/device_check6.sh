#!/usr/bin/env bash
# The sixth GPU session's checks (about 4 minutes), after the fifth's mend and the tests' new launcher:
# - tests/test_eager.py, whose children lost the machine's PYTHONPATH in the fifth session (mended:
#   tests/cli_driver.child_env), beside the CUDA-only tests.
#   Since 2026-11-27's seventh stop it also runs the app with device=cuda: no torch._dynamo imported
#   (pipeline/determinism.py sets torch's kernels' switch without the compiler's).
# - the multi-process tests through tests/zygote.py (rank processes forked from a server that has
#   imported torch) on another machine, Python and torch than the VM's: test_zygote, the pipeline's
#   and the replicas' equivalence to one process.
#
#   bash bench/device_check6.sh            # on the GPU machine, from the repository root
source "$(dirname "$0")/device_env.sh"  # Python ready, $out, the device named
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_sync.py tests/test_memory.py tests/test_readme.py \
  tests/test_activation_policy.py tests/test_eager.py tests/test_zygote.py -k "cuda or eager or zygote" 2>&1 \
  | tee "$out/cuda_tests.log" | tail -4
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_equivalence.py tests/test_data_parallel.py 2>&1 \
  | tee "$out/spawned.log" | tail -4
