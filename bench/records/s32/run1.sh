#!/usr/bin/env bash
# Thirty-second session, call 1 (one H200): the whole GPU test suite on main 9d8825b (the FP8
# reuse tests' shared backend never ran on a GPU), then 8b LoRA r16 (bf16 base) at 131,072 tokens
# in 64/24 with NVML and RSS sampled (bench.budget_truth): the long-sequence budget check after
# the thirty-first session's adapter changes (kept s(x a^T) products).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests > $OUT/gpu-tests.log 2>&1
echo "pytest -m gpu rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -12 | cut -c1-200
left=$((575 - (SECONDS - T0)))
timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --lora-rank 16 --out /tmp/bt 8b:131072:64:24 2>&1 | tail -12 | tee $OUT/bt.log
mkdir -p $OUT/bt && cp /tmp/bt/*.json $OUT/bt/ 2>/dev/null; ls /tmp/bt
