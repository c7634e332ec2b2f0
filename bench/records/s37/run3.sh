#!/usr/bin/env bash
# Thirty-seventh session, call 3, NOT RUN (no machine could start; 577 s of budget left): issue 53's
# 65,536-token pair, bf16 and fp8 in 100/24, 2 sequences a step, on one GPU in one call. Everything the call writes is tarred into one file (only 8 files come back).
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s37c3; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $R/gpu.txt
for prec in bf16 fp8; do
  left=$((265 - SECONDS)); [ $left -gt 125 ] && [ $prec = bf16 ] && left=125; [ $left -gt 90 ] || { echo "no time for 65k $prec"; continue; }
  (cd /tmp && timeout $left dataflow-demo 100 24 65536 8b --steps 3 --tokens-per-step 131072 --precision $prec --json > $R/65k-$prec.json 2> $R/65k-$prec.log)
  echo "65k $prec rc $? at $SECONDS s: $(grep -E '^summary' $R/65k-$prec.log | cut -c1-170)"
done
tar czf $OUT/call3.tgz -C /tmp s37c3
