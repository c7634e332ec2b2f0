#!/usr/bin/env bash
# Thirtieth session, call 2: LoRA on an fp8-stored 70b base at 120/24 GiB, budgets sampled
# (bench.budget_truth: NVML device memory and the process tree's RSS every 0.2 s), 3 steps.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
free -g | tee $OUT/free.txt
timeout 540 python3 -m dataflow.bench.budget_truth --steps 3 --timeout 520 --lora-rank 16 --lora-base fp8 --out $OUT/bt 70b:8192:120:24 2>&1 | tail -30 | tee $OUT/bt.log
ls $OUT/bt
