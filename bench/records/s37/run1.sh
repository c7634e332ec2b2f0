#!/usr/bin/env bash
# Thirty-seventh session, call 1 (one H100 or H200): what s36's run3/run4 never ran. Issue 55:
# the grouped-GEMM GPU test as changed (bf16 / fp32 only) and the probe (cuBLAS grouped GEMM
# against the per-expert cuBLASLt loop and a dense GEMM of the same FLOPs, olmoe-1b-7b 8k).
# Issue 56: split-update replicas (two CuPy ranks sharing the GPU) against one device given
# room (40:12). Issue 53: fp8 guessed against current scales, traced, on 112M and then 8b.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cublaslt.py > $OUT/cublaslt-test.log 2>&1
echo "cublaslt tests rc $?: $(tail -1 $OUT/cublaslt-test.log)"
timeout 90 python3 -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 8192 --out $OUT/grouped-olmoe-8k.json 2>&1 | tail -14 | tee $OUT/grouped.log
timeout 130 python3 -m dataflow.bench.ring_gpu 1b 4096 --out /tmp/ring-su --gpus 2 --replicas 2 --split-update \
  --transport shm --ring-budget 30:8 --single-budget 40:12 --steps 2 --timeout 120 2>&1 | tail -8 | tee $OUT/ring-su-table.txt
(cd /tmp && tar czf $OUT/ring-su.tgz ring-su 2>/dev/null)
M=$PWD/bench/records/s28-fp8/m112.json
for scales in current guessed; do
  left=$((330 - SECONDS)); [ $left -gt 40 ] || { echo "no time for m112 $scales"; continue; }
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout $left dataflow-demo 16 16 1024 $M --tokens-per-step 16384 --steps 12 --precision fp8 --trace /tmp/m112-$scales.trace.json --json > $OUT/m112-$scales.json 2> $OUT/m112-$scales.log)
  echo "m112 $scales rc $? at $SECONDS s: $(grep -E '^summary' $OUT/m112-$scales.log | cut -c1-160)"
  python3 -m dataflow.bench.trace_ops /tmp/m112-$scales.trace.json --top 14 --out $OUT/m112-$scales.ops.json > $OUT/m112-$scales.ops.txt 2>&1
done
for scales in current guessed; do
  left=$((575 - SECONDS)); [ $left -gt 110 ] || { echo "no time for 8b $scales"; continue; }
  (cd /tmp && DATAFLOW_FP8_SCALES=$scales timeout $left dataflow-demo 80 24 8192 8b --steps 3 --precision fp8 --trace /tmp/8b-$scales.trace.json --json > $OUT/8b-$scales.json 2> $OUT/8b-$scales.log)
  echo "8b $scales rc $? at $SECONDS s: $(grep -E '^summary' $OUT/8b-$scales.log | cut -c1-160)"
  python3 -m dataflow.bench.trace_ops /tmp/8b-$scales.trace.json --top 14 --out $OUT/8b-$scales.ops.json > $OUT/8b-$scales.ops.txt 2>&1
done
python3 bench/records/s37/compare_ops.py "$OUT"
