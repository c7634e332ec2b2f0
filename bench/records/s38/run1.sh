#!/usr/bin/env bash
# Thirty-eighth session, call 1: every GPU test (the new overlapped-rounds ring test among them),
# then the split-update ring against its fixed one-device baseline, then the measurement command's
# overlapped rounds on CuPy over shm, given the time. Everything in one tar (only 8 files come back).
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s38c1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs > $R/gpu-all.log 2>&1
echo "gpu tests rc $? at $SECONDS s: $(tail -1 $R/gpu-all.log)"; grep -E '^FAILED' $R/gpu-all.log | head
left=$((510 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left python3 -m dataflow.bench.ring_gpu 1b 4096 --out $R/ring-su --gpus 2 --replicas 2 --split-update \
    --transport shm --ring-budget 30:8 --single-budget 40:16 --steps 2 --timeout $((left - 5)) 2>&1 | tail -9 | tee $R/ring-su-table.txt
else echo "no time for ring-su"; fi
left=$((575 - SECONDS))
[ $left -gt 50 ] && timeout $left python3 -m dataflow.bench.ring_gpu small 256 --out $R/ring-ov --gpus 2 \
  --transport shm --round-overlap --rounds 3 --ring-budget 2:1 --single-budget 2:2 --steps 2 \
  --timeout $((left - 5)) 2>&1 | tail -8 | tee $R/ring-ov-table.txt
tar czf $OUT/call1.tgz -C /tmp s38c1
