#!/usr/bin/env bash
# Eighteenth session, call D (two GPUs): where a data-parallel replica's extra time goes. 8b at
# 60/24, 2 replicas of a ring of 1, 1 x 8k x 16 rounds, 3 steps, every rank traced
# (dataflow-ring --trace: compute / exposed copy / host / idle per step); then one GPU alone at
# 60/24 with the same rounds (the demo traces itself), on this machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
nvidia-smi --query-gpu=name --format=csv,noheader | uniq -c
timeout 160 python3 -m dataflow.bench.ring_gpu 8b 8192 --gpus 2 --replicas 2 --ring-budget 60:24 --no-single --steps 3 --rounds 16 --trace --timeout 150 --out $R/dp2 > $R/dp2.log 2>&1
echo "dp2 rc $?"; grep -E "step [23]: compute" $R/dp2/ring.log | cut -c1-200; tail -5 $R/dp2.log; pack
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m dataflow.bench.demo 60 24 8192 8b --rounds 16 --steps 3 --json > $R/one.json 2> $R/one.log
echo "one rc $?"; grep -E "^step [23]: compute|^Prediction" $R/one.log | cut -c1-200
python3 -c "
import json; d=json.load(open('$R/one.json')); print('one GPU step s', [round(s['step_time_s'],2) for s in d['steps']])"
pack; rm -rf $R
