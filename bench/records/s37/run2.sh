#!/usr/bin/env bash
# Thirty-seventh session, call 2 (the same warm H100 as call 1): call 1's files that did not come
# back (a count limit), tarred; the one-device baseline of the split-update ring given room
# (40:12 did not fit: 12.2 GiB), and 8b at 8192 in 80/24 in bf16, the twin of call 1's fp8 runs.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
prev=$(dirname "$(find / -name grouped-olmoe-8k.json -not -path '/proc/*' 2>/dev/null | head -1)")
echo "call 1 out: $prev"; [ -n "$prev" ] && tar czf $OUT/call1.tgz -C "$prev" . 2>/dev/null
timeout 150 python3 -m dataflow.bench.ring_gpu 1b 4096 --out /tmp/ring-su2 --gpus 2 --replicas 2 --split-update \
  --transport shm --ring-budget 30:8 --single-budget 40:16 --steps 2 --timeout 140 2>&1 | tail -8 | tee $OUT/ring-su-table.txt
(cd /tmp && tar czf $OUT/ring-su2.tgz ring-su2 2>/dev/null)
left=$((560 - SECONDS))
(cd /tmp && timeout $left dataflow-demo 80 24 8192 8b --steps 3 --json > $OUT/8b-bf16.json 2> $OUT/8b-bf16.log)
echo "8b bf16 rc $? at $SECONDS s: $(grep -E '^summary' $OUT/8b-bf16.log | cut -c1-160)"
