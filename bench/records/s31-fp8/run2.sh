#!/usr/bin/env bash
# Thirty-first session, call 2 (one H200): 8b LoRA r16 (all seven targets, bf16 base) at 8192 in
# 64/24 traced, step 3 summarised by op kind (where LoRA's step goes beside full fine-tuning's);
# then LoRA on the fp8 base at 131,072 tokens in 64/24 with NVML and RSS sampled
# (bench.budget_truth), the long-sequence budget check the fp8 base still lacked.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 200 dataflow-demo 64 24 8192 8b --lora-rank 16 --steps 3 --json --trace /tmp/t-lora.json > $OUT/8b-lora.json 2> /tmp/tr-lora.log
echo "traced lora rc $? at $((SECONDS-T0)) s"; grep -E "^summary|Error|error:" /tmp/tr-lora.log | head -3 | cut -c1-200
python3 -m dataflow.bench.trace_ops /tmp/t-lora.json --step 3 --top 40 --out $OUT/ops-lora.json > $OUT/ops-lora.txt 2>&1
head -50 $OUT/ops-lora.txt
left=$((570 - (SECONDS - T0)))
timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --lora-rank 16 --lora-base fp8 --out /tmp/bt 8b:131072:64:24 2>&1 | tail -12 | tee $OUT/bt.log
mkdir -p $OUT/bt && cp /tmp/bt/*.json $OUT/bt/ 2>/dev/null; ls /tmp/bt
