#!/usr/bin/env bash
# Twenty-second session, call B (2 GPUs), tree da44e9a + the cuBLASLt preference that allows split-K
# partials only in fp32. GPU 0: budget_truth on the planner's olmoe plan (2 steps, memory sampled).
# GPU 1 meanwhile: transformers' OlmoeForCausalLM baseline; which split-K scheme cuBLASLt picks with
# and without the preference; the cuBLASLt test that failed in call A with its seed, then 3 fresh
# seeds; moe_experts_bench --as-engine. Then the whole `pytest -m gpu` on both GPUs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
G=$PWD/.gpu
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m dataflow.bench.hf_train_throughput olmoe-1b-7b --seqlen 8192 --steps 3 --batches 2,1 --out $R/hf-olmoe.json > $R/hf-olmoe.log 2>&1; echo "hf rc $? at $((SECONDS-T0)) s" >> $R/hf-olmoe.log
  timeout 30 python3 $G/splitk_probe.py > $R/splitk-probe.log 2>&1; echo "probe rc $?" >> $R/splitk-probe.log
  K="tests/kernels/test_cublaslt.py::test_gemm_loop_matches_float64_over_changing_sizes"
  DATAFLOW_TEST_SEED=5653523427062883239 timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider "$K" > $R/cublaslt-seed.log 2>&1; echo "seed rc $?" >> $R/cublaslt-seed.log
  for i in 1 2 3; do timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider "$K" 2>&1 | tail -1; done > $R/cublaslt-fresh.log
  timeout 60 python3 -m dataflow.bench.moe_experts_bench olmoe-1b-7b --tokens 16384 --as-engine --out $R/moe-bench.json > $R/moe-bench.log 2>&1 ) &
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m dataflow.bench.budget_truth --steps 2 --timeout 190 --out $R/bt olmoe-1b-7b:8192:120:24 > $R/bt-olmoe.log 2>&1
echo "bt olmoe rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-olmoe.log | tail -1 | cut -c1-500; grep -hE "^Chunking|^Prediction|^step 2: (loss|compute|largest)" $R/bt/*.log | cut -c1-300; pack
wait; echo "gpu1 done at $((SECONDS-T0)) s"; tail -1 $R/hf-olmoe.log; tail -2 $R/cublaslt-seed.log; cat $R/cublaslt-fresh.log; tail -4 $R/moe-bench.log
python3 -c "import json;d=json.load(open('$R/hf-olmoe.json'));print({k:d.get(k) for k in ('device','batch','step_times_s','tok_per_s','mfu')})" 2>&1 | tail -1
grep -c "scheme" $R/splitk-probe.log; grep "1 48 64" $R/splitk-probe.log
pack
unset CUDA_VISIBLE_DEVICES
timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider > $R/gpu-tests.log 2>&1
echo "all gpu tests rc $? at $((SECONDS-T0)) s"; tail -4 $R/gpu-tests.log
pack; rm -rf $R
