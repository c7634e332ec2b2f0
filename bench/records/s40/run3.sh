#!/usr/bin/env bash
# Fortieth session, call 4: the compiled model after its link fix, checked on the plans it now
# picks. 8b at 8k and at 4k, 80/24, 16,384 tokens a step: the estimate's pick ("estimate"), the
# thirty-ninth session's pick ("s39", measured in call2/) and today's ("compiled", from
# bench/records/s40/plans/), each 5 steps in the same call; NVML memory used and the demo's RSS
# sampled every 0.5 s; first the host's embedding-gradient norm (kernels.host.norms) timed. One
# tar comes back. PICKS (default "estimate s39 compiled"), SEQS ("8192 4096") and LIMIT (seconds,
# default 560) trim it.
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s40c4; mkdir -p $R; P40=$PWD/bench/records/s40/plans; P39=$PWD/bench/records/s39/plans
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $R/gpu.txt
python3 -c "
import time, numpy as np
from dataflow.kernels.host.norms import sumsq
import ml_dtypes
for dt in (ml_dtypes.bfloat16, np.float32):
    x = np.random.default_rng(0).standard_normal(128256 * 4096, dtype=np.float32).astype(dt)
    sumsq(x); t = time.perf_counter()
    for _ in range(5): sumsq(x)
    s = (time.perf_counter() - t) / 5
    print(f'host sumsq of 8b embedding grad {x.dtype} {x.nbytes / 1e9:.2f} GB: {s * 1e3:.1f} ms, {x.nbytes / s / 1e9:.1f} GB/s')
from dataflow.kernels.host.adamw import adamw_step
n = 218_112_000  # one 8b layer
p, m, v = (x.astype(ml_dtypes.bfloat16) for x in np.random.default_rng(1).standard_normal((3, n), dtype=np.float32) * 0.01)
g = np.random.default_rng(2).standard_normal(n, dtype=np.float32).astype(ml_dtypes.bfloat16)
adamw_step(p, g, m, v, 1, 1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0); t = time.perf_counter()
for k in range(2, 5): adamw_step(p, g, m, v, k, 1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0)
s = (time.perf_counter() - t) / 3
print(f'host AdamW of one 8b layer ({n / 1e6:.0f} M bf16 params, bf16 grads): {s * 1e3:.0f} ms, {n / s / 1e6:.0f} M params/s, {14 * n / s / 1e9:.1f} GB/s at 14 B a parameter')
" 2>&1 | tee $R/host-sumsq.txt
for seq in ${SEQS:-8192 4096}; do for pick in ${PICKS:-estimate s39 compiled}; do
  left=$((${LIMIT:-560} - SECONDS)); [ $left -gt 100 ] && left=100; [ $left -gt 50 ] || { echo "no time for $seq $pick"; continue; }
  name=8b-$seq-16384-$pick; plan=$P40/$name.json
  [ $pick = s39 ] && plan=$P39/8b-$seq-16384-compiled.json
  (cd /tmp && timeout $left dataflow-demo 80 24 $seq 8b --plan $plan --steps 5 --json > $R/$name.json 2> $R/$name.log) &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    echo "$(date +%s.%N) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) $(ps -eo rss=,comm= | awk '$2 ~ /python|dataflow/ {s+=$1} END {print s}')" >> $R/$name.mem
    sleep 0.5
  done
  wait $pid; rc=$?
  echo "$name rc $rc at $SECONDS s: $(grep -E '^summary' $R/$name.log | cut -c40-110) | $(grep -E '^Prediction' $R/$name.log | cut -c50-70) | peak MiB/RSS KiB: $(sort -k2 -n $R/$name.mem | tail -1 | cut -d' ' -f2) $(sort -k3 -n $R/$name.mem | tail -1 | cut -d' ' -f3)"
done; done
tar czf $OUT/call4.tgz -C /tmp s40c4
