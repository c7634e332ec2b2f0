#!/usr/bin/env bash
# Thirty-fourth session, call 1: the 112M pair in the order current, guessed, current (in the
# thirty-third session guessed ran first and was slower, 55,709 against 85,530 tok/s mean: a
# first-run warm-up or the guesses?), then the 8b triple at 8192 in 80/24 through
# bench.budget_truth (NVML and RSS sampled): fp8 guessed, fp8 current and bf16 in one call.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
STD=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p /tmp/stdlib
i=0; for f in $(find $STD -name "*.py" -not -path "*/test/*" -not -path "*/tests/*" -not -path "*/site-packages/*" | sort); do
  i=$((i+1)); cp "$f" /tmp/stdlib/$(printf %05d $i).txt; done
M=$PWD/bench/records/s28-fp8/m112.json
n=0
for scales in current guessed current; do
  n=$((n+1))
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout 110 dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 150 --data /tmp/stdlib --precision fp8 --json > $OUT/m112-$n-$scales.json 2> /tmp/m112-$n.log)
  echo "m112 fp8 $scales rc $? at $((SECONDS-T0)) s: $(grep -E '^summary' /tmp/m112-$n.log | cut -c1-160)"
done
python3 - <<'PY'
import json, os, statistics
out = os.environ["OUT"]
runs = {}
for n, k in ((1, "current"), (2, "guessed"), (3, "current")):
    try:
        d = json.load(open(f"{out}/m112-{n}-{k}.json"))
    except Exception as e:  # noqa: BLE001
        print(f"m112 {n} {k}: {e!r}"[:200]); continue
    runs[n] = d
    tps = [s["tok_per_s"] for s in d["steps"]]
    print(f"m112 {n} {k:<8} mean {statistics.mean(tps):>9,.0f} median {statistics.median(tps):>9,.0f}"
          f" min {min(tps):>9,.0f} tok/s (steps 11+ mean {statistics.mean(tps[10:]):>9,.0f});"
          f" last loss {d['steps'][-1]['loss']:.4f}; fp8_scales {d.get('fp8_scales')}")
if len(runs) == 3:
    l = {n: [s["loss"] for s in runs[n]["steps"]] for n in runs}
    print(f"losses bit for bit: 1==2 {l[1] == l[2]}, 1==3 {l[1] == l[3]}")
PY
for run in fp8:guessed fp8cur:current bf16:current; do
  name=${run%%:*}; pr=${name%cur}; scales=${run##*:}
  left=$((585 - (SECONDS - T0)))
  [ $left -gt 90 ] || { echo "no time for $name"; break; }
  DATAFLOW_FP8_SCALES=$scales timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --precision $pr --out /tmp/bt-$name 8b:8192:80:24 2>&1 | tail -1 | tee -a $OUT/bt.log
  cp /tmp/bt-$name/*.demo.json $OUT/$name.demo.json 2>/dev/null
done
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*.demo.json")):
    try:
        d = json.load(open(f))
        s = d["steps"][-1]
        print(f"{os.path.basename(f):<18} step {s['step']} {s['tok_per_s']:>9,.0f} tok/s pred "
              f"{d['plan']['prediction']['tok_per_s']:>9,.0f} fp8_scales {d.get('fp8_scales')}")
    except Exception as e:  # noqa: BLE001
        print(f"{f}: {e!r}"[:200])
PY
