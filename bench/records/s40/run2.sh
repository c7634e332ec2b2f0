#!/usr/bin/env bash
# Fortieth session, call 3: why the few-rounds plans run 12-16 % under their compiled prediction
# (call2/): the 8k pair traced (3 steps each, --trace), the stall table of each measured step
# beside it (dataflow.instrument.stalls), then a 128k capped cell with NVML and RSS sampled.
set -uo pipefail
source bench/records/device_setup.sh
R=/tmp/s40c3; mkdir -p $R; P=$PWD/bench/records/s39/plans
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee $R/gpu.txt
for pick in compiled estimate; do
  name=8b-8192-16384-$pick
  (cd /tmp && timeout 120 dataflow-demo 80 24 8192 8b --plan $P/$name.json --steps 3 --json --trace $R/$name.trace.json > $R/$name.json 2> $R/$name.log)
  echo "$name rc $? at $SECONDS s: $(grep -E '^summary' $R/$name.log | cut -c1-150)"
  python3 -m dataflow.instrument.stalls $R/$name.trace.json --step 3 --top 14 > $R/$name.stalls.txt 2>&1
  python3 -m dataflow.bench.trace_ops $R/$name.trace.json --step 3 --top 25 > $R/$name.ops.txt 2>&1
  head -8 $R/$name.stalls.txt
done
left=$((560 - SECONDS)); echo "128k with $left s left"
if [ $left -gt 150 ]; then
  name=8b-131072-262144
  (cd /tmp && timeout $((left - 20)) dataflow-demo 120 24 131072 8b --tokens-per-step 262144 --steps 2 --json > $R/$name.json 2> $R/$name.log) &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    echo "$(date +%s.%N) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) $(ps -eo rss=,comm= | awk '$2 ~ /python|dataflow/ {s+=$1} END {print s}')" >> $R/$name.mem
    sleep 0.5
  done
  wait $pid; echo "$name rc $? at $SECONDS s: $(grep -E '^summary' $R/$name.log | cut -c1-150) peak MiB/RSS KiB: $(sort -k2 -n $R/$name.mem | tail -1 | cut -d' ' -f2) $(sort -k3 -n $R/$name.mem | tail -1 | cut -d' ' -f3)"
fi
gzip $R/*.trace.json
tar czf $OUT/call3.tgz -C /tmp s40c3
