#!/usr/bin/env bash
# Thirty-sixth session, call 1 (one H100 or H200): the whole GPU suite (the NCCL split-update
# calls over a one-rank communicator ran nowhere yet), issue 55's library question: does
# cuBLAS's grouped GEMM beat the per-expert cuBLASLt loop at olmoe-1b-7b's shapes, and does this
# image's cuBLASLt header offer a grouped mode with device-side sizes? Then issue 56's schedules
# through bench.ring_gpu on one GPU (two CuPy ranks sharing it over shared memory).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for hdr in $(find / -name cublasLt.h -not -path '*/proc/*' 2>/dev/null | head -2); do
  echo "== $hdr"; grep -n -i "group" "$hdr" | head -30
done > $OUT/cublaslt-header.txt 2>&1
python3 -c "import cupy; print('cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
python3 -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 8192 --out $OUT/grouped-olmoe-8k.json 2>&1 | tail -14 | tee $OUT/grouped.log
python3 -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 32768 --out $OUT/grouped-olmoe-32k.json 2>&1 | tail -14 | tee -a $OUT/grouped.log
T0=$SECONDS
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-all.log 2>&1
echo "pytest rc $? in $((SECONDS - T0)) s"
tail -8 $OUT/gpu-all.log
# issue 56 on one GPU: CuPy ranks sharing it over shared memory, against one device
for run in vocab:--vocab-parallel-head su:"--replicas 2 --split-update"; do
  name=${run%%:*}; left=$((560 - SECONDS))
  [ $left -gt 60 ] || { echo "no time for $name"; continue; }
  timeout $left python3 -m dataflow.bench.ring_gpu 1b 4096 --out $OUT/ring-$name --gpus 2 ${run#*:} \
    --transport shm --ring-budget 30:8 --single-budget 30:8 --steps 2 --timeout $((left - 10)) \
    2>&1 | tail -7
done
head -c 3000 $OUT/cublaslt-header.txt
