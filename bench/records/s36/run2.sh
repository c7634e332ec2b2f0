#!/usr/bin/env bash
# Thirty-sixth session, call 2 (issue 53): why guessed FP8 scales ran slower than current ones
# on the H100 (s34: 112M 0.928x, 8b 0.982x) though they give the same bits. The 112M fp8 pair
# and then the 8b fp8 pair at 8192 in 80/24, each traced (dataflow-demo --trace), and
# bench.trace_ops on every trace: the op kinds whose time differs between the two modes.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=$PWD/bench/records/s28-fp8/m112.json
for scales in current guessed; do
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout 100 dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 12 --precision fp8 --trace /tmp/m112-$scales.trace.json --json > $OUT/m112-$scales.json 2> $OUT/m112-$scales.log)
  echo "m112 $scales rc $? at $SECONDS s: $(grep -E '^summary' $OUT/m112-$scales.log | cut -c1-150)"
  python3 -m dataflow.bench.trace_ops /tmp/m112-$scales.trace.json --top 14 --out $OUT/m112-$scales.ops.json > $OUT/m112-$scales.ops.txt 2>&1
done
for scales in current guessed; do
  left=$((560 - SECONDS)); [ $left -gt 100 ] || { echo "no time for 8b $scales"; continue; }
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout $left dataflow-demo 80 24 8192 8b --steps 3 --precision fp8 --trace /tmp/8b-$scales.trace.json --json > $OUT/8b-$scales.json 2> $OUT/8b-$scales.log)
  echo "8b $scales rc $? at $SECONDS s: $(grep -E '^summary' $OUT/8b-$scales.log | cut -c1-150)"
  python3 -m dataflow.bench.trace_ops /tmp/8b-$scales.trace.json --top 14 --out $OUT/8b-$scales.ops.json > $OUT/8b-$scales.ops.txt 2>&1
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for model in ("m112", "8b"):
    runs = {}
    for s in ("current", "guessed"):
        try:
            runs[s] = json.load(open(f"{out}/{model}-{s}.ops.json"))
        except Exception as e:  # noqa: BLE001
            print(f"{model} {s}: {e!r}"[:160])
    if len(runs) < 2:
        continue
    c, g = runs["current"], runs["guessed"]
    print(f"{model}: step wall ms current {c['wall_ms']:,.1f}, guessed {g['wall_ms']:,.1f}; "
          f"compute idle {c['compute_idle_ms']:,.1f} vs {g['compute_idle_ms']:,.1f}")
    for stream in c["streams"]:
        a = {r["op"]: r["total_ms"] for r in c["streams"][stream]}
        b = {r["op"]: r["total_ms"] for r in g["streams"].get(stream, [])}
        diffs = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)),
                       key=lambda x: -abs(x[0]))
        print(f"  {stream}: guessed - current, largest: "
              + ", ".join(f"{k} {d:+.1f} ms" for d, k in diffs[:6]))
PY
