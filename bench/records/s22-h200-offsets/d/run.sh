#!/usr/bin/env bash
# Twenty-second session, call D (2 GPUs), tree 268d40c (the refitted expert constants): the demos as
# the planner now plans them. GPU 0: budget_truth olmoe-1b-7b 120/24 8k (now 4 chunks x 16 rounds),
# 2 steps; GPU 1 at the same time: transformers' OlmoeForCausalLM baseline. Then GPU 0:
# budget_truth qwen3-30b-a3b 180/90 8k at 4 rounds (the planner now takes 2 chunks a round there, a
# layout the refit did not see), 3 steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m dataflow.bench.hf_train_throughput olmoe-1b-7b --seqlen 8192 --steps 3 --batches 2,1 --out $R/hf-olmoe.json > $R/hf-olmoe.log 2>&1; echo "hf rc $? at $((SECONDS-T0)) s" >> $R/hf-olmoe.log ) &
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m dataflow.bench.budget_truth --steps 2 --timeout 190 --out $R/bt-olmoe olmoe-1b-7b:8192:120:24 > $R/bt-olmoe.log 2>&1
echo "bt olmoe rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-olmoe.log | tail -1 | cut -c1-500; grep -hE "^Chunking|^Prediction|^step 2: (loss|compute|largest)" $R/bt-olmoe/*.log | cut -c1-330; pack
wait; tail -1 $R/hf-olmoe.log
python3 -c "import json;d=json.load(open('$R/hf-olmoe.json'));print({k:d.get(k) for k in ('device','batch','step_times_s','tok_per_s','mfu')})" 2>&1 | tail -1
timeout 300 python3 -m dataflow.bench.budget_truth --steps 3 --rounds 4 --timeout 290 --out $R/bt-qwen3 qwen3-30b-a3b:8192:180:90 > $R/bt-qwen3.log 2>&1
echo "bt qwen3 rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-qwen3.log | tail -1 | cut -c1-500; grep -hE "^Chunking|^Prediction|^step [23]: (loss|compute|largest)" $R/bt-qwen3/*.log | cut -c1-330
pack; rm -rf $R
