#!/usr/bin/env bash
# Thirty-first session, call 4 (one H200): the FP8 GPU tests after the host-span fix (call 3 crashed fp8 on it),
# then 8b at 8192 in 80/24 GiB in fp8 and its bf16 twin on the planner's own plans, 2 steps each,
# NVML and RSS sampled (bench.budget_truth).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/dataflow/test_gpu_precision_fp8.py > $OUT/gpu-tests.log 2>&1
echo "pytest rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR|Error" $OUT/gpu-tests.log | head -12 | cut -c1-300
for pr in fp8 bf16; do
  left=$((575 - (SECONDS - T0)))
  [ $left -gt 100 ] || break
  timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --precision $pr --out $OUT/$pr 8b:8192:80:24 2>&1 | tail -2 | tee -a $OUT/bt.log
  rm -f $OUT/$pr/*.log
done
