#!/usr/bin/env bash
# Thirtieth session, call 1: the grouped expert GEMMs' and the LoRA fp8 base's GPU tests; when
# the grouped tests pass, the grouped kernels' speed beside the loop (bench.moe_experts_bench)
# and olmoe-1b-7b's whole steps at 120/24 both ways (bench.budget_truth, 4 rounds a step).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,power.limit --format=csv | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q tests/kernels/test_moe_grouped_cuda.py tests/kernels/test_fp8_base_cuda.py 2>&1 | tail -25 | tee $OUT/tests-kernels.log
grep -q "failed\|error" $OUT/tests-kernels.log && { echo "kernel tests failed: stopping"; exit 1; }
for spec in "olmoe-1b-7b 8192" "olmoe-1b-7b 16384" "qwen3-30b-a3b 8192"; do
  set -- $spec
  timeout 90 python3 -m dataflow.bench.moe_experts_bench $1 --tokens $2 --grouped --as-engine --repeat 3 --out $OUT/bench-$1-$2.json 2>&1 | tail -9 | tee -a $OUT/bench.log
done
timeout 200 python3 -m pytest -q tests/dataflow/test_engine_moe_cuda.py tests/dataflow/test_gpu_lora_fp8_base.py tests/kernels/test_cuda_moe.py 2>&1 | tail -25 | tee $OUT/tests-engine.log
for mode in grouped loop; do
  DATAFLOW_MOE_EXPERTS=$mode timeout 200 python3 -m dataflow.bench.budget_truth --steps 3 --rounds 4 --timeout 190 --out $OUT/bt-$mode olmoe-1b-7b:8192:120:24 2>&1 | tail -6 | tee -a $OUT/bt.log
done
