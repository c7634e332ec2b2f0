#!/usr/bin/env bash
# Twenty-second session, call F (2 GPUs, run on GPU 0), tree 51743ec: the first MoE cell at 128k with
# memory sampled: budget_truth olmoe-1b-7b 131072 120/24 (8 chunks a round of one split sequence),
# 1 round a step, 2 steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
export CUDA_VISIBLE_DEVICES=0
timeout 220 python3 -m dataflow.bench.budget_truth --steps 2 --rounds 1 --timeout 200 --out $R/bt olmoe-1b-7b:131072:120:24 > $R/bt-olmoe-128k.log 2>&1
echo "bt rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-olmoe-128k.log | tail -1 | cut -c1-500; grep -hE "^Chunking|^Prediction|^step [12]: (loss|compute)" $R/bt/*.log | cut -c1-300
pack; rm -rf $R
