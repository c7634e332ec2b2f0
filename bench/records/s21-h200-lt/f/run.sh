#!/usr/bin/env bash
# Twenty-first session, call F (2 GPUs), tree 60412d9: strided-batch pairs in the expert loop and the
# planner's expert cost. GPU 0: moe_experts_bench (engine layout), the olmoe demo at 120/24 8192 with the
# planner's plan (budget_truth, 2 steps), then the demo with --rounds 16 (the plan measured in calls C/D).
# GPU 1 meanwhile: transformers' OlmoeForCausalLM baseline, then the MoE GPU tests.
# Then the whole `pytest -m gpu` on both GPUs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m dataflow.bench.hf_train_throughput olmoe-1b-7b --seqlen 8192 --steps 3 --batches 2,1 --out $R/hf-olmoe.json > $R/hf-olmoe.log 2>&1; echo "hf rc $? at $((SECONDS-T0)) s" >> $R/hf-olmoe.log
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_cublaslt.py tests/kernels/test_cuda_moe.py tests/dataflow/test_engine_moe_cuda.py > $R/moe-gpu-tests.log 2>&1; echo "moe gpu tests rc $? at $((SECONDS-T0)) s" >> $R/moe-gpu-tests.log ) &
export CUDA_VISIBLE_DEVICES=0
timeout 60 python3 -m dataflow.bench.moe_experts_bench olmoe-1b-7b --tokens 16384 --as-engine --out $R/moe-bench.json > $R/moe-bench.log 2>&1
echo "moe bench rc $? at $((SECONDS-T0)) s"; tail -5 $R/moe-bench.log; pack
timeout 200 python3 -m dataflow.bench.budget_truth --steps 2 --timeout 190 --out $R/bt olmoe-1b-7b:8192:120:24 > $R/bt-olmoe.log 2>&1
echo "bt olmoe rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-olmoe.log | tail -1 | cut -c1-500; grep -E "^Chunking|^Prediction|^step [12]:" $R/bt/*.log | cut -c1-300; pack
timeout 130 python3 -m dataflow.bench.demo 120 24 8192 olmoe-1b-7b --steps 2 --rounds 16 > $R/demo-r16.log 2>&1
echo "demo r16 rc $? at $((SECONDS-T0)) s"; grep -E "^Chunking|^Prediction|^step [12]: (loss|largest)" $R/demo-r16.log | cut -c1-300; pack
wait; tail -2 $R/moe-gpu-tests.log; tail -1 $R/hf-olmoe.log
python3 -c "import json;d=json.load(open('$R/hf-olmoe.json'));print({k:d.get(k) for k in ('device','batch','tried','step_times_s','tok_per_s','mfu','peak_allocated_gib')})" 2>&1 | tail -1
pack
unset CUDA_VISIBLE_DEVICES
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/gpu-tests.log 2>&1
echo "all gpu tests rc $? at $((SECONDS-T0)) s"; tail -4 $R/gpu-tests.log
pack; rm -rf $R
