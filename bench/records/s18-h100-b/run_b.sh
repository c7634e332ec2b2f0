#!/usr/bin/env bash
# Eighteenth session, call B (one GPU): issue 40's and 41's GPU checks. GPU tests of the tied
# embedding, the Qwen families and the new MoE CUDA ops (and the kernel precompile); Llama,
# Mistral and tied Llama trained from transformers' saved directories on CuPy against
# transformers; dataflow-demo (budget_truth: NVML and psutil sampled) for llama3.2-1b at 40/16
# and 1b beside it, qwen3-8b at 80/24 and 8b beside it, 8k each, 2 steps.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=60 tests/kernels/test_cuda_moe.py tests/kernels/test_cuda_tied.py tests/models/test_qwen_families.py tests/dataflow/test_gpu_pinning.py -k "not pinning or precompile" > $R/gpu-tests.log 2>&1
echo "pytest rc $? at $((SECONDS-T0)) s"; grep -E "FAILED|ERROR|passed|failed" $R/gpu-tests.log | cut -c1-200 | tail -14; pack
for fam in "llama" "mistral" "llama --tied"; do
  tag=$(echo $fam | tr -d ' -')
  timeout 50 python3 -m dataflow.bench.family_check --family $fam --backend cupy --out $R/family-$tag-cupy.json > $R/family-$tag-cupy.log 2>&1; echo "family $fam rc $? at $((SECONDS-T0)) s"; tail -2 $R/family-$tag-cupy.log | cut -c1-400
done; pack
timeout 200 python3 -m dataflow.bench.budget_truth --steps 2 --timeout 95 --out $R/bt llama3.2-1b:8192:40:16 1b:8192:40:16 > $R/bt-1b.log 2>&1
echo "bt 1b rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-1b.log | tail -2 | cut -c1-300; pack
timeout $((560 - (SECONDS - T0))) python3 -m dataflow.bench.budget_truth --steps 2 --timeout 250 --out $R/bt qwen3-8b:8192:80:24 8b:8192:80:24 > $R/bt-8b.log 2>&1
echo "bt 8b rc $? at $((SECONDS-T0)) s"; grep -v "^$" $R/bt-8b.log | tail -2 | cut -c1-300
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ['OUT'] + '/r/bt/*.json')):
    if f.endswith(('.demo.json', '.plan.json')):
        continue
    d = json.load(open(f))
    print(os.path.basename(f), {k: d.get(k) for k in ('status', 'tok_per_s', 'predicted_tok_per_s', 'measured_over_predicted', 'device_above_budget_bytes', 'host_overshoot_bytes')})
PY
pack; rm -rf $R
