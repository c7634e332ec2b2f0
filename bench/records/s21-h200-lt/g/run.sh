#!/usr/bin/env bash
# Twenty-first session, call G (2 GPUs): A/B of the expert loop's strided-batch pairs in the demo, same
# machine, same time: GPU 0 runs tree new (HEAD, pairs batched), GPU 1 tree old (HEAD with fa2ec53's
# moe_experts.py: one call per GEMM); dataflow-demo 120 24 8192 olmoe-1b-7b --steps 2 --rounds 16 each.
# Then the trace GPU test whose stub table met the new backend close.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
G=$PWD/.gpu; T0=$SECONDS
R=$OUT/r; rm -rf $R; mkdir -p $R
pack() { (cd $OUT && tar czf all.tgz r); }
( cd $G/old; export PYTHONPATH=$PWD:/tmp/site CUDA_VISIBLE_DEVICES=1; cat COMMIT > $R/demo-old.log
  timeout 150 python3 -m dataflow.bench.demo 120 24 8192 olmoe-1b-7b --steps 2 --rounds 16 >> $R/demo-old.log 2>&1; echo "old rc $? at $((SECONDS-T0)) s" >> $R/demo-old.log ) &
cd $G/new; export PYTHONPATH=$PWD:/tmp/site CUDA_VISIBLE_DEVICES=0; cat COMMIT > $R/demo-new.log
timeout 150 python3 -m dataflow.bench.demo 120 24 8192 olmoe-1b-7b --steps 2 --rounds 16 >> $R/demo-new.log 2>&1; echo "new rc $? at $((SECONDS-T0)) s" >> $R/demo-new.log
wait
for v in new old; do echo "== $v"; grep -E "^step [12]: (loss|largest)|rc " $R/demo-$v.log | cut -c1-260; done
pack
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/dataflow/test_trace.py > $R/trace-test.log 2>&1; echo "trace test rc $? at $((SECONDS-T0)) s"; tail -1 $R/trace-test.log
pack; rm -rf $R
