#!/usr/bin/env bash
# Thirty-first session, call 5 (one H200): the GPU tests of the LoRA changes (the scale as the
# adapters' GEMM alpha, kept (T, r) products), then 8b at 8192 in 64/24 GiB: LoRA r16 on all seven
# targets (bf16 base) beside full fine-tuning, then LoRA again (the spread), NVML and RSS sampled.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/kernels/test_cuda_ops.py tests/dataflow/test_gpu_lora.py tests/dataflow/test_gpu_lora_fp8_base.py > $OUT/gpu-tests.log 2>&1
echo "pytest rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -12 | cut -c1-300
run() {  # name, extra flags
  left=$((440 - (SECONDS - T0)))
  [ $left -gt 40 ] || { echo "no time for $1"; return; }
  timeout $((left - 3)) python3 -m dataflow.bench.budget_truth --steps "$3" --timeout $((left - 10)) $2 --out $OUT/$1 8b:8192:64:24 2>&1 | tail -1 | sed "s/^/$1: /" | tee -a $OUT/bt.log
  rm -f $OUT/$1/*.log $OUT/$1/*.plan.json
}
run lora "--lora-rank 16" 3
run full "" 2
run lora2 "--lora-rank 16" 3
