#!/usr/bin/env bash
# Twenty-seventh session, call 1 (one H200): the whole GPU test suite on main, then 8b at 8192 in
# 80/24 with 4 rounds a step, traced in fp8 then bf16, each step 2 summarised by op kind
# (bench.trace_ops; the traces stay on the machine).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nvidia_cudnn*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 320 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests > $OUT/gpu-tests.log 2>&1
echo "pytest -m gpu rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu-tests.log | head -12 | cut -c1-200
for pr in fp8 bf16; do
  left=$((585 - (SECONDS - T0)))
  [ $left -gt 70 ] || break
  timeout $((left - 5)) dataflow-demo 80 24 8192 8b --precision $pr --steps 2 --rounds 4 --json --trace /tmp/t-$pr.json > $OUT/8b-$pr.json 2> /tmp/tr-$pr.log
  echo "traced $pr rc $? at $((SECONDS-T0)) s"; grep -E "^summary|Error|error:" /tmp/tr-$pr.log | head -3 | cut -c1-200
  python3 -m dataflow.bench.trace_ops /tmp/t-$pr.json --step 2 --top 16 --out $OUT/ops-$pr.json > $OUT/ops-$pr.txt 2>&1
  head -30 $OUT/ops-$pr.txt
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for name in ("8b-fp8", "8b-bf16"):
    try:
        d = json.load(open(f"{out}/{name}.json")); s = d["steps"]; p = d["plan"]
        pred = p["prediction"]["tok_per_s"]
        print(f"{name:<8} step2 {s[-1]['tok_per_s']:>9,.0f} pred {pred:>9,.0f} ratio {s[-1]['tok_per_s']/pred:.3f} "
              f"loss {s[0]['loss']:.5f} {s[-1]['loss']:.5f} chunk {p.get('chunk_tokens')} rounds {p.get('rounds')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name} failed: {e!r}"[:200])
PY
