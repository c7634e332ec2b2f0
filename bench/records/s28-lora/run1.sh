#!/usr/bin/env bash
# Twenty-eighth session, call 3 (one H200): 8b at 8192 with LoRA r=16 on all seven targets in
# 64/24 beside full fine-tuning in 64/24, and LoRA in 24/24 (bench.budget_truth: NVML and RSS
# sampled), after the adapter-first ordering (dataflow/layer_ops.py) and the cost model's host
# gather rate (h-lora). Records under $OUT. A time guard (END) keeps the call short.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nvidia_cudnn*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS; END=${END:-290}
bt() { left=$((END - (SECONDS - T0))); [ $left -gt 50 ] || { echo "skip $1: $left s left"; return; }
  timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --out /tmp/bt/$1 --timeout $((left - 15)) "${@:2}" 2>&1 | tail -1 | cut -c1-300; echo "$1 at $((SECONDS-T0)) s"; }
bt lora-8b-64 --steps 3 --lora-rank 16 8b:8192:64:24
bt full-8b-64 --steps 2 8b:8192:64:24
bt lora-8b-24 --steps 3 --lora-rank 16 8b:8192:24:24
for d in /tmp/bt/*; do for f in $d/*.json; do case $f in *.plan.json|*.demo.json) ;; *) cp $f $OUT/$(basename $d).json;; esac; done; done 2>/dev/null
python3 - <<'PY'
import json, glob, os
print(f"{'record':<12} {'status':<7} {'tok/s':>8} {'pred':>8} {'m/p':>6} {'dev peak':>9} {'dev over':>9} {'rss':>7} {'host over':>9} {'MHz':>5}")
g = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    r = json.load(open(f)); t, p = r.get("tok_per_s"), r.get("predicted_tok_per_s")
    print(f"{os.path.basename(f)[:-5]:<12} {r['status']:<7} {t or 0:>8,.0f} {p or 0:>8,.0f} {(t or 0) / (p or 1):>6.3f} "
          f"{g(r.get('peak_device_used_bytes')):>9} {g(r.get('device_overshoot_bytes')):>9} {g(r.get('peak_rss_bytes')):>7} {g(r.get('host_overshoot_bytes')):>9} {r.get('sm_clock_mhz_mean') or 0:>5.0f}  {(r.get('error') or '')[:80]}")
PY
