#!/usr/bin/env bash
# Twenty-seventh session, call 3 (one H200): the LoRA and probe GPU tests, LoRA against
# transformers + peft (B random so A's gradient is checked), then 8b at 8192 with LoRA r=16 on all
# seven targets in 24/24 and in 64/24 beside full fine-tuning in 64/24 (bench.budget_truth: NVML
# and RSS sampled), and 32b with LoRA in 80/24 if the time allows. Records under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nvidia_cudnn*.whl >/dev/null 2>&1 || echo "wheel install failed"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peftlib .whl/peft*.whl .whl/accelerate*.whl >/dev/null 2>&1 || echo "peft install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/dataflow/test_gpu_lora.py tests/dataflow/test_probe.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? at $((SECONDS-T0)) s: $(tail -1 $OUT/gpu-tests.log)"
grep -E "^FAILED|^ERROR|^E " $OUT/gpu-tests.log | head -8 | cut -c1-220
PYTHONPATH=/tmp/site:/tmp/peftlib timeout 130 python3 -m dataflow.bench.lora_vs_peft --b-std 0.02 --out $OUT/lora-vs-peft-h200.json > /tmp/peft.log 2>&1
echo "lora_vs_peft rc $? at $((SECONDS-T0)) s"; tail -4 /tmp/peft.log | cut -c1-300
python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/lora-vs-peft-h200.json"))
    for k, v in d.items():
        if not isinstance(v, (list, dict)) or k in ("families",): print(k, str(v)[:160])
    for fam in d.get("families", d if isinstance(d, dict) else {}):
        pass
except Exception as e: print("no record", e)
PY
bt() { left=$((575 - (SECONDS - T0))); [ $left -gt 60 ] || { echo "skip $1: $left s left"; return; }
  timeout $((left - 5)) python3 -m dataflow.bench.budget_truth --out /tmp/bt/$1 --timeout $((left - 15)) "${@:2}" 2>&1 | tail -1 | cut -c1-300; echo "$1 at $((SECONDS-T0)) s"; }
bt lora-8b-24 --steps 3 --lora-rank 16 8b:8192:24:24
bt lora-8b-64 --steps 3 --lora-rank 16 8b:8192:64:24
bt full-8b-64 --steps 2 8b:8192:64:24
bt lora-32b-80 --steps 3 --lora-rank 16 32b:8192:80:24
for d in /tmp/bt/*; do for f in $d/*.json; do case $f in *.plan.json|*.demo.json) ;; *) cp $f $OUT/$(basename $d).json;; esac; done; done 2>/dev/null
python3 - <<'PY'
import json, glob, os
print(f"{'record':<14} {'status':<7} {'tok/s':>8} {'pred':>8} {'m/p':>6} {'dev peak':>9} {'dev over':>9} {'rss':>7} {'host over':>9}")
g = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
for f in sorted(glob.glob(os.environ["OUT"] + "/*-8*.json") + glob.glob(os.environ["OUT"] + "/*-32b*.json")):
    r = json.load(open(f)); t, p = r.get("tok_per_s"), r.get("predicted_tok_per_s")
    print(f"{os.path.basename(f)[:-5]:<14} {r['status']:<7} {t or 0:>8,.0f} {p or 0:>8,.0f} {(t or 0) / (p or 1):>6.3f} "
          f"{g(r.get('peak_device_used_bytes')):>9} {g(r.get('device_overshoot_bytes')):>9} {g(r.get('peak_rss_bytes')):>7} {g(r.get('host_overshoot_bytes')):>9}  {(r.get('error') or '')[:80]}")
PY
