#!/usr/bin/env bash
# Twenty-sixth session, call 5 (one H200, the session's last device minutes): the FP8 GPU tests
# with the reuse test fixed, then 8b at 8192 in 80/24 in fp8 alone (operand reuse): its bf16 twin
# is call 2's (same kind, another call), and its losses must equal call 2's fp8 run bit for bit
# (reuse skips a quantise pass that would write the same bytes).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/dataflow/test_gpu_precision_fp8.py > $OUT/t_fp8.log 2>&1
echo "fp8 tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_fp8.log | head -8 | cut -c1-220
timeout 185 dataflow-demo 80 24 8192 8b --precision fp8 --steps 2 --json > $OUT/8b-fp8.json 2> $OUT/8b-fp8.log
echo "8b fp8 rc $? at $((SECONDS-T0)) s"; grep -E "^summary|step 2: largest|rror" $OUT/8b-fp8.log | head -4 | cut -c1-260
python3 -c "
import json; s=json.load(open('$OUT/8b-fp8.json'))['steps']; print('losses', [x['loss'] for x in s], 'tok/s', [round(x['tok_per_s']) for x in s])"
