# Sourced by bench/device_check*.sh: the GPU machine's Python made ready, the output folder, the device named.
# A machine with no package index: put the wheels of what its Python lacks (hydra-core, omegaconf,
# antlr4-python3-runtime) in .whl/ and carry it; they are installed into /tmp/site.
set -u
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import torch, networkx, hydra" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  elif ! python3 -m pip install -q -e '.[test]'; then
    echo "device_env.sh: no package index here; carry the wheels (on the workstation: pip download hydra-core==1.3.8" \
         "omegaconf==2.3.1 -d .whl; pip wheel antlr4-python3-runtime==4.9.3 -w .whl; run with carry=['.whl'])" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"
  nproc; } 2>&1 | tee "$out/device.txt"
