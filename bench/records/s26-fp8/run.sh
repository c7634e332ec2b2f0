#!/usr/bin/env bash
# Twenty-sixth session, one H200: the FP8 GPU tests, then dataflow-demo pairs, each fp8 run beside
# its bf16 twin in the same call (2 steps each; JSON and log under $OUT), and a table.
# Usage: run.sh [--no-tests] RUN...   RUN = NAME:HOST_GB:DEV_GB:SEQLEN:MODEL (each run in fp8, then bf16)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS; END=${END:-575}
if [ "${1:-}" = --no-tests ]; then shift; else
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dataflow/test_gpu_precision_fp8.py tests/kernels/test_fp8_cuda.py > $OUT/t_fp8.log 2>&1
echo "fp8 tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_fp8.log | head -8 | cut -c1-220
fi
for run in "$@"; do
  IFS=: read -r name h d s m <<< "$run"
  for pr in fp8 bf16; do
    left=$((END - (SECONDS - T0)))
    timeout $left dataflow-demo $h $d $s $m --precision $pr --steps 2 --json > $OUT/$name-$pr.json 2> $OUT/$name-$pr.log
    echo "$name $pr rc $? at $((SECONDS-T0)) s"; grep -E "^summary|Error|error:" $OUT/$name-$pr.log | head -3 | cut -c1-200
  done
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print(f"{'run':<12} {'step 2 tok/s':>12} {'predicted':>10} {'meas/pred':>9} {'loss 1':>9} {'loss 2':>9}")
for name in sorted(f[:-5] for f in os.listdir(out) if f.endswith(".json")):
    try:
        d = json.load(open(f"{out}/{name}.json")); s = d["steps"]; pred = d["plan"]["prediction"]["tok_per_s"]
        print(f"{name:<12} {s[-1]['tok_per_s']:>12,.0f} {pred:>10,.0f} {s[-1]['tok_per_s'] / pred:>9.3f} {s[0]['loss']:>9.5f} {s[-1]['loss']:>9.5f}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:<12} failed: {e!r}"[:200])
PY
