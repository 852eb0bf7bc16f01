#!/usr/bin/env bash
# Where a tensor-managed run's time outside its steps goes (2026-11-28's H100 check: `hybrid` and
# `device` at 4x spent 1.5-4 s more of train_time_s outside their steps than all-resident, which
# itself spent ~9 s of 13 s there). One all-resident and one `hybrid` 4x run of bench/cuda_placements.py's
# setting under cProfile (the main thread): of each, the project's 60 costliest calls by cumulative time
# and the 30 costliest by own time.
#   bash bench/device_profile10.sh [device] [layers] [width] [steps]
source "$(dirname "$0")/device_env.sh"
dev="${1:-cuda}"; layers="${2:-8}"; width="${3:-1024}"; steps="${4:-24}"
read -r -a base < <(python3 -c "
import argparse, sys; sys.path.insert(0, '.')
from bench.cuda_placements import space_args
a = argparse.Namespace(layers=$layers, width=$width, tokens=64, batch=256, steps=$steps, device='$dev')
print(' '.join(space_args(a)))")
state=$(python3 -c "
import sys; sys.path.insert(0, '.')
from bench.composition_table import op_state_bytes
print(op_state_bytes('transformer', [o for o in '${base[*]}'.split() if not o.startswith(('space=', 'device='))]))")
for run in resident hybrid; do
  more=(); [ "$run" = hybrid ] && more=("memory.device_budget_bytes=$((state / 4))" memory.optimizer=hybrid)
  timeout 150 python3 -m cProfile -o "$out/$run.prof" -m search "${base[@]}" "${more[@]}" "hydra.run.dir=/tmp/prof_$run" \
    > "$out/$run.log" 2>&1; echo "$run rc=$?"
  python3 -c "
import json, pstats, sys
s = json.load(open('/tmp/prof_$run/summary.json')); print('$run', 'train_time_s', s['train_time_s'], 'wall', s.get('wall_time_s'))
st = [json.loads(l)['seconds'] for l in open('/tmp/prof_$run/metrics.jsonl') if l.strip()]; print('steps sum', round(sum(st), 2), 'n', len(st))
st = pstats.Stats('$out/$run.prof'); st.sort_stats('cumulative').print_stats('(pipeline|search|supernet)/', 60); st.sort_stats('tottime').print_stats(30)" 2>&1 | cut -c1-220 > "$out/$run.top"
  head -3 "$out/$run.top"; rm -rf "/tmp/prof_$run"
done
