#!/usr/bin/env bash
# Thirty-seventh session, call 4, NOT RUN (no machine could start; 397 s of budget left after the try): the
# new GPU test of overlapped rounds on the CuPy backend (two ranks sharing the GPU over shared
# memory, overlapped against plain, bit for bit), then the split-update ring with the fixed
# one-device baseline if time is left. Everything in one tar (only 8 files come back).
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s37c4; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ring/test_ring_gpu_overlap.py > $R/overlap-test.log 2>&1
echo "overlap test rc $? at $SECONDS s: $(tail -1 $R/overlap-test.log)"
left=$((165 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left python3 -m dataflow.bench.ring_gpu 1b 4096 --out $R/ring-su --gpus 2 --replicas 2 --split-update \
    --transport shm --ring-budget 30:8 --single-budget 40:16 --steps 2 --timeout $((left - 5)) 2>&1 | tail -9 | tee $R/ring-su-table.txt
else echo "no time for ring-su"; fi
left=$((240 - SECONDS))  # (given the time) the measurement command's overlapped rounds on CuPy
[ $left -gt 60 ] && timeout $left python3 -m dataflow.bench.ring_gpu small 256 --out $R/ring-ov --gpus 2 \
  --transport shm --round-overlap --rounds 3 --ring-budget 2:1 --single-budget 2:2 --steps 2 \
  --timeout $((left - 5)) 2>&1 | tail -8 | tee $R/ring-ov-table.txt
tar czf $OUT/call4.tgz -C /tmp s37c4
