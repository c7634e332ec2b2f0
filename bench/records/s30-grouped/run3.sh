#!/usr/bin/env bash
# Thirtieth session, call 3: 8b at 8192 in 64/24 GiB, LoRA r=16 on an fp8 base and a bf16 base
# beside full fine-tuning, in one call (bench.budget_truth: NVML and RSS sampled), 2 steps each.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
timeout 120 python3 -m dataflow.bench.budget_truth --timeout 110 --lora-rank 16 --lora-base fp8 --out $OUT/lora-fp8 8b:8192:64:24 2>&1 | tail -3 | tee -a $OUT/bt.log
timeout 120 python3 -m dataflow.bench.budget_truth --timeout 110 --lora-rank 16 --out $OUT/lora-bf16 8b:8192:64:24 2>&1 | tail -3 | tee -a $OUT/bt.log
timeout 300 python3 -m dataflow.bench.budget_truth --timeout 290 --out $OUT/full 8b:8192:64:24 2>&1 | tail -3 | tee -a $OUT/bt.log
