#!/usr/bin/env bash
# Thirty-third session, call 2: the m112 pair again in the other order (current first: in call 1
# guessed ran first and was slower, 55,709 against 85,530 tok/s mean, with stalls in single
# steps), the 8b fp8 run with current scales beside call 1's guessed and bf16 twins (that call
# ran out of time before it), then the whole GPU suite.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p /tmp/stdlib
i=0; for f in $(find $STD -name "*.py" -not -path "*/test/*" -not -path "*/tests/*" -not -path "*/site-packages/*" | sort); do
  i=$((i+1)); cp "$f" /tmp/stdlib/$(printf %05d $i).txt; done
M=$PWD/bench/records/s28-fp8/m112.json
for scales in current guessed current; do
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout 120 dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 150 --data /tmp/stdlib --precision fp8 --json > /tmp/m112-$scales.json 2> /tmp/m112-$scales.log)
  echo "m112 fp8 $scales rc $? at $((SECONDS-T0)) s: $(grep -E '^summary' /tmp/m112-$scales.log | cut -c1-160)"
done
DATAFLOW_FP8_SCALES=current timeout 200 python3 -m dataflow.bench.budget_truth --steps 2 --timeout 190 --precision fp8 --out /tmp/fp8cur 8b:8192:80:24 2>&1 | tail -1
cp /tmp/fp8cur/*.demo.json $OUT/fp8cur.demo.json 2>/dev/null
left=$((560 - (SECONDS - T0)))
timeout $left python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests > $OUT/gpu-all.log 2>&1
echo "pytest -m gpu rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-all.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu-all.log | head -12 | cut -c1-240
