#!/usr/bin/env bash
# Twenty-second session, call A (2 GPUs): is the MoE offsets copy queued behind the engine's transfers?
# .gpu/wait_probe.py runs dataflow-demo 120 24 8192 olmoe-1b-7b --steps 2 with the offsets store timed
# (GPU time between events around it, host wait) per step and kind; GPU 0 the memcpy (before), GPU 1
# the kernel through the mapping (new), at the same time: first the planner's layout, then --rounds 16.
# Then the MoE GPU tests (kernels incl. the new mapped-store test, engine MoE, cuBLASLt).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
P=$PWD/.gpu/wait_probe.py
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site; C=$(cat COMMIT); echo "tree $C"; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
run() { # name gpu mode args...
  local name=$1 gpu=$2 mode=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 170 python3 $P $mode 120 24 8192 olmoe-1b-7b --steps 2 "$@" > $R/$name.log 2>&1
  echo "$name rc $? at $((SECONDS-T0)) s" >> $R/$name.log; }
run r32-copy 0 copy & run r32-mapped 1 mapped; wait
pack
run r16-copy 0 copy --rounds 16 & run r16-mapped 1 mapped --rounds 16; wait
pack
for n in r32-copy r32-mapped r16-copy r16-mapped; do echo "== $n"; grep -E "^Chunking|^step 2: (loss|largest)|^wait_probe 2|rc " $R/$n.log | cut -c1-330; done
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_cuda_moe.py tests/kernels/test_cublaslt.py tests/dataflow/test_engine_moe_cuda.py > $R/moe-gpu-tests.log 2>&1
echo "moe gpu tests rc $? at $((SECONDS-T0)) s"; tail -3 $R/moe-gpu-tests.log
pack; rm -rf $R
