#!/usr/bin/env bash
# Twenty-sixth session, call 2 (one H200): the CuPy FP8 linear ops against the NumPy FP8 table
# and a tiny engine in fp8 (GPU against NumPy), then 8b at 8192 in 80/24, fp8 beside its bf16
# twin (2 steps each, the demo's JSON and log under $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
DATAFLOW_FP8_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dataflow/test_gpu_precision_fp8.py > $OUT/t_ops.log 2>&1
echo "op tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_ops.log | head -12 | cut -c1-220
for pr in ${RUNS:-fp8 bf16}; do
  DATAFLOW_FP8_GPU=1 timeout $((560 - (SECONDS - T0) > 250 ? 250 : 560 - (SECONDS - T0))) dataflow-demo 80 24 8192 8b --precision $pr --steps 2 --json > $OUT/8b-$pr.json 2> $OUT/8b-$pr.log
  echo "8b $pr rc $? at $((SECONDS-T0)) s"; grep -E "^summary|Prediction|tok/s, model|Error|error" $OUT/8b-$pr.log | head -5 | cut -c1-220
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
print(f"{'run':<10} {'step 2 tok/s':>12} {'predicted':>10} {'loss 1':>9} {'loss 2':>9}")
for name in sorted(f[:-5] for f in os.listdir(out) if f.endswith(".json")):
    try:
        d = json.load(open(f"{out}/{name}.json")); s = d["steps"]
        pred = d["plan"].get("prediction", {}).get("tok_per_s", float("nan")) if isinstance(d["plan"], dict) else float("nan")
        print(f"{name:<10} {s[-1]['tok_per_s']:>12,.0f} {pred:>10,.0f} {s[0]['loss']:>9.5f} {s[-1]['loss']:>9.5f}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:<10} failed: {e!r}"[:200])
PY
