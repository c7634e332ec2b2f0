#!/usr/bin/env bash
# Thirty-sixth session, call 2: call 1's probe died on numpy ints and its grouped test's
# bf16-to-fp32 case got NOT_SUPPORTED (now refused by name). The grouped-GEMM test again, the
# probe at olmoe-1b-7b 8k, the split-update ring on one GPU against one device given room (its
# ranks fit 8 GiB only with half the AdamW state), then issue 53's 112M fp8 pair traced.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cublaslt.py 2>&1 | tail -3
timeout 90 python3 -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 8192 --out $OUT/grouped-olmoe-8k.json 2>&1 | tail -14
timeout 120 python3 -m dataflow.bench.ring_gpu 1b 4096 --out $OUT/ring-su --gpus 2 --replicas 2 --split-update \
  --transport shm --ring-budget 30:8 --single-budget 40:12 --steps 2 --timeout 110 2>&1 | tail -7
M=$PWD/bench/records/s28-fp8/m112.json
for scales in current guessed; do
  left=$((190 - SECONDS)); [ $left -gt 40 ] || { echo "no time for m112 $scales"; continue; }
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout $left dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 12 --precision fp8 --trace /tmp/m112-$scales.trace.json --json > $OUT/m112-$scales.json 2> $OUT/m112-$scales.log)
  echo "m112 $scales rc $? at $SECONDS s: $(grep -E '^summary' $OUT/m112-$scales.log | cut -c1-150)"
  python3 -m dataflow.bench.trace_ops /tmp/m112-$scales.trace.json --top 14 --out $OUT/m112-$scales.ops.json > $OUT/m112-$scales.ops.txt 2>&1
  head -20 $OUT/m112-$scales.ops.txt
done
