#!/usr/bin/env bash
# Twenty-second session, call E (2 GPUs), tree 28b730e: the first MoE model of released size on a ring
# on GPUs. bench.ring_gpu qwen3-30b-a3b 8192 --gpus 2 --ring-budget 95:90 (a ring of 2; one GPU does not
# fit 95/90) against one GPU at 180:90 (the smallest compute-bound budgets one rank fits on this 256 GiB
# machine), 4 rounds a step, 3 steps each, one after the other, memory sampled.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
timeout 540 python3 -m dataflow.bench.ring_gpu qwen3-30b-a3b 8192 --gpus 2 --ring-budget 95:90 --single-budget 180:90 --rounds 4 --steps 3 --timeout 260 --single-timeout 240 --out $R/ring > $R/ring-qwen3.log 2>&1
echo "ring_gpu rc $? at $((SECONDS-T0)) s"; tail -25 $R/ring-qwen3.log | cut -c1-300
pack; rm -rf $R
