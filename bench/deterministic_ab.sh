#!/usr/bin/env bash
# What deterministic kernels cost a real CUDA run: the app (200 steps, training only) on the conv
# space and the transformer (w256 l8), deterministic with torch's fill of new memory (before
# pipeline/determinism.py turned it off), without it (now), and off; two rounds, JSON lines to
# $OUT/deterministic_ab.jsonl with each run's train_time_s and params_digest. Needs CUDA; run from
# the repository root (bench/device_check2.sh runs it).
python3 -c "import hydra" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:${PYTHONPATH:-}; }
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
for r in 1 2; do for v in fill nofill off; do for sp in conv transformer; do
  extra=""; [ $sp = transformer ] && extra="space.width=256 space.layers=8"
  det=true; [ $v = off ] && det=false
  d=/tmp/ab-$v-$r-$sp
  timeout 90 python3 -c "import runpy,sys; import pipeline.determinism as D; D.FILL_UNINITIALIZED_MEMORY = ('$v' == 'fill'); sys.argv=['search']+sys.argv[1:]; runpy.run_module('search', run_name='__main__')" space=$sp $extra train.steps=200 search=none train.checkpoint_every=0 train.monitor_every=0 device=cuda deterministic=$det output_dir=$d >/dev/null 2>$d.err || tail -2 $d.err
  python3 -c "import json; s=json.load(open('$d/summary.json')); print(json.dumps({'bench':'deterministic','round':$r,'variant':'$v','space':'$sp','train_time_s':s['train_time_s'],'params_digest':s['params_digest'][:16]}))" | tee -a $OUT/deterministic_ab.jsonl
done; done; done
