#!/usr/bin/env bash
# Twenty-seventh session, call 2 (one H200): 8b at 8192 in 80/24 on the planner's own plans, fp8
# then bf16 in the same call, through bench.budget_truth (NVML device memory and the process
# tree's RSS sampled every 0.2 s while each runs), then 8b at 65,536 in 100/24 in fp8 at 2 rounds
# a step if the time allows. Records and demo logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nvidia_cudnn*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
mkdir -p /tmp/bt
for pr in fp8 bf16; do
  timeout $((570 - (SECONDS - T0))) python3 -m dataflow.bench.budget_truth --out /tmp/bt/$pr --precision $pr --steps 2 --timeout 280 8b:8192:80:24 2>&1 | tail -2 | cut -c1-300
  echo "8k $pr done at $((SECONDS-T0)) s"
done
left=$((580 - (SECONDS - T0)))
if [ $left -gt 130 ]; then
  timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --out /tmp/bt/fp8-64k --precision fp8 --rounds 2 --steps 2 --timeout $((left - 15)) 8b:65536:100:24 2>&1 | tail -2 | cut -c1-300
  echo "64k fp8 done at $((SECONDS-T0)) s"
fi
for d in fp8 bf16 fp8-64k; do for f in /tmp/bt/$d/*.json; do case $f in *.plan.json) ;; *) cp $f $OUT/$d-$(basename $f);; esac; done; done 2>/dev/null
python3 - <<'PY'
import json, glob, os
print(f"{'record':<36} {'status':<7} {'tok/s':>8} {'pred':>8} {'m/p':>6} {'dev peak':>9} {'dev over':>9} {'rss':>7} {'host over':>9}")
g = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    if f.endswith(".demo.json"): continue
    r = json.load(open(f)); t, p = r.get("tok_per_s"), r.get("predicted_tok_per_s")
    print(f"{os.path.basename(f)[:36]:<36} {r['status']:<7} {t or 0:>8,.0f} {p or 0:>8,.0f} {(t or 0) / (p or 1):>6.3f} "
          f"{g(r.get('peak_device_used_bytes')):>9} {g(r.get('device_overshoot_bytes')):>9} {g(r.get('peak_rss_bytes')):>7} {g(r.get('host_overshoot_bytes')):>9}")
PY
