#!/usr/bin/env bash
# Thirty-ninth session, call 2 (NOT RUN this session: no machine was lent): the few-rounds pick
# (memplan.search.search RESCORED_CHUNKINGS) measured. 8b at 8k and at 4k, 80/24, 16,384 tokens a
# step: the plan make_plan chose before (estimate) and the one it chooses now (compiled), from
# bench/records/s39/plans/ (python bench/records/s39/plans.py), each 5 steps in the same call;
# NVML memory used and the demo's RSS sampled every 0.5 s beside it. One tar comes back.
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s39c2; mkdir -p $R; P=$PWD/bench/records/s39/plans
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $R/gpu.txt
for seq in 8192 4096; do for pick in estimate compiled; do
  left=$((540 - SECONDS)); [ $left -gt 130 ] && left=130; [ $left -gt 60 ] || { echo "no time for $seq $pick"; continue; }
  name=8b-$seq-16384-$pick
  (cd /tmp && timeout $left dataflow-demo 80 24 $seq 8b --plan $P/$name.json --steps 5 --json > $R/$name.json 2> $R/$name.log) &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    echo "$(date +%s.%N) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) $(ps -eo rss=,comm= | awk '$2 ~ /python|dataflow/ {s+=$1} END {print s}')" >> $R/$name.mem
    sleep 0.5
  done
  wait $pid; rc=$?
  echo "$name rc $rc at $SECONDS s: $(grep -E '^summary' $R/$name.log | cut -c1-170) peak MiB/RSS KiB: $(sort -k2 -n $R/$name.mem | tail -1 | cut -d' ' -f2) $(sort -k3 -n $R/$name.mem | tail -1 | cut -d' ' -f3)"
done; done
tar czf $OUT/call2.tgz -C /tmp s39c2
