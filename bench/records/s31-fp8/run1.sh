#!/usr/bin/env bash
# Thirty-first session, call 1 (one H200): the whole GPU test suite on main 7072994 (not run since
# the state_parts merge), then 1b at 8192 in 40/16 traced in fp8 and bf16, each step 2 summarised
# by op kind (bench.trace_ops), to see where 1b's fp8 step loses its GEMM speed-up.
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
for pr in fp8 bf16; do
  left=$((570 - (SECONDS - T0)))
  [ $left -gt 60 ] || break
  timeout $((left - 5)) dataflow-demo 40 16 8192 1b --precision $pr --steps 2 --json --trace /tmp/t-$pr.json > $OUT/1b-$pr.json 2> /tmp/tr-$pr.log
  echo "traced $pr rc $? at $((SECONDS-T0)) s"; grep -E "^summary|Error|error:" /tmp/tr-$pr.log | head -3 | cut -c1-200
  python3 -m dataflow.bench.trace_ops /tmp/t-$pr.json --step 2 --top 24 --out $OUT/ops-$pr.json > $OUT/ops-$pr.txt 2>&1
  head -34 $OUT/ops-$pr.txt
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for name in ("1b-fp8", "1b-bf16"):
    try:
        d = json.load(open(f"{out}/{name}.json")); s = d["steps"]; p = d["plan"]
        pred = p["prediction"]["tok_per_s"]
        print(f"{name:<8} step2 {s[-1]['tok_per_s']:>9,.0f} pred {pred:>9,.0f} ratio {s[-1]['tok_per_s']/pred:.3f} "
              f"loss {s[0]['loss']:.5f} {s[-1]['loss']:.5f} chunk {p.get('chunk_tokens')} rounds {p.get('rounds')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name} failed: {e!r}"[:200])
PY
