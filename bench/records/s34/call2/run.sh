#!/usr/bin/env bash
# Thirty-fourth session, call 2 (H100, or an H200 where no H100 comes): the built-in H100 profile has no FP8 GEMM rate, so its
# fp8 plans were made as if FP8 GEMMs ran at the bf16 rate (call 1: predicted 8,315, measured
# 10,901 / 11,106 tok/s). bench.fp8_gemm measures the H100's FP8 speedup on 8b's block GEMMs; the
# rate the H200 profile derives the same way goes into a cached profile (the dataflow-probe
# cache, which get_profile prefers over the built-in of the same name); then the 8b pair at 8192
# in 80/24 and the 1b pair at 8192 in 40/16, fp8 (current scales) beside bf16, planned with it.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m dataflow.bench.fp8_gemm --out $OUT/fp8_gemm-h100.json | tail -2
python3 - <<'PY'
import dataclasses, json, os
from dataflow.memplan.plan import profiles as pr
d = json.load(open(os.environ["OUT"] + "/fp8_gemm-h100.json"))
speedup = d["block"]["speedup_gemms"]
rate = 780e12 * pr.SUSTAINED_POWER_FACTOR * speedup
print(f"{d['device']}: FP8 GEMMs {speedup:.3f}x bf16 -> fp8 rate {rate / 1e12:,.0f} TFLOP/s "
      f"(H200 built-in {pr.H200_FP8_GEMM_FLOP_PER_S / 1e12:,.0f})")
if "H100" in d["device"]:  # an H200 keeps its built-in rate: the run checks it
    p = dataclasses.replace(pr.BUILTIN_PROFILES["h100"], fp8_gemm_flop_per_s=rate)
    print(f"cached at {pr.save_profile(p, pr.default_cache_path())}")
PY
export DATAFLOW_FP8_SCALES=current
for run in fp8:8b:8192:80:24 bf16:8b:8192:80:24 fp8:1b:8192:40:16 bf16:1b:8192:40:16; do
  pr=${run%%:*}; cell=${run#*:}; name=$pr-${cell%%:*}
  left=$((585 - (SECONDS - T0)))
  [ $left -gt 60 ] || { echo "no time for $name"; break; }
  timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --steps 2 --timeout $((left - 15)) --precision $pr --out /tmp/bt-$name $cell 2>&1 | tail -1 | tee -a $OUT/bt.log
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
              f"{d['plan']['prediction']['tok_per_s']:>9,.0f} plan {d['plan_hash']}")
    except Exception as e:  # noqa: BLE001
        print(f"{f}: {e!r}"[:200])
PY
