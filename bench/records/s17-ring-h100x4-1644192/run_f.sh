#!/usr/bin/env bash
# Seventeenth session, call F (four GPUs): the layouts that now weigh smaller chunks for a full
# ring. 8b at 30/24 per GPU, the planner's choice for 4 GPUs (8 rounds a replica to fit the
# call), against one GPU at 120/24 with the ring's chunking (losses) and at its own chunking
# (speed); 32b at 64/40 on the 4 GPUs (its chosen ring, 2 steps); 32b at 120/40 on 2 of them.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; nvidia-smi --query-gpu=name --format=csv,noheader | wc -l
R=$OUT/r; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
timeout 260 python3 -m dataflow.bench.ring_gpu 8b 8192 --gpus 4 --replicas auto --ring-budget 30:24 --single-budget 120:24 --single-own --steps 3 --rounds 8 --timeout 120 --out $R/auto4 > $R/auto4.log 2>&1
echo "auto4 rc $?"; tail -12 $R/auto4.log; pack
timeout 170 python3 -m dataflow.bench.ring_gpu 32b 8192 --gpus 4 --replicas auto --ring-budget 64:40 --no-single --steps 2 --rounds 8 --timeout 160 --out $R/r32b4 > $R/r32b4.log 2>&1
echo "r32b4 rc $?"; tail -6 $R/r32b4.log; pack
CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m dataflow.bench.ring_gpu 32b 8192 --gpus 2 --replicas 1 --ring-budget 120:40 --no-single --steps 2 --rounds 8 --timeout 140 --out $R/r32b2 > $R/r32b2.log 2>&1
echo "r32b2 rc $?"; tail -6 $R/r32b2.log; pack
rm -rf $R
