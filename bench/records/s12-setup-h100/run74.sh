#!/bin/bash
# GPU tests of setup, then setup A/B (8b 131k 120/24) with DATAFLOW_PREBUILD 0/1 alternating, fresh caches
# each; then 1b 1M 120/24 setup once (prebuild on).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/.whl/*.whl || exit 1
cp .gpu/setup_ab.py .gpu/new/
cd .gpu/new; export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
C=$(cat COMMIT)
timeout 150 python3 -u -m pytest -q -m gpu tests/dataflow/test_gpu_pinning.py -p no:cacheprovider 2>&1 | tee $OUT/gpu-pinning-$C.log | tail -3
one() {
  d=$(mktemp -d)
  DATAFLOW_PREBUILD=$1 CUPY_CACHE_DIR=$d/cupy DATAFLOW_CUDNN_CACHE_DIR=$d/cudnn NUMBA_CACHE_DIR=$d/numba \
    timeout 150 python3 setup_ab.py $2 $3 $4 $5 2>>$OUT/setup-ab-$C.err | tee -a $OUT/setup-ab-$C.jsonl | \
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); p=r['phases']; print('$2', '$3', r['prebuild_env'], round(r['setup_s'],1), {k: round(v,1) for k,v in p.items()}, 'pre', {k: round(v,1) for k,v in r['prebuild'].items()}, 'warm', {k: round(v,1) if isinstance(v,float) else v for k,v in r['warm_up'].items()}, 'pin', {k: round(v,1) for k,v in r['pin'].items() if k.endswith('_s')})"
}
for flag in 0 1 0 1; do one $flag 8b 131072 120 24; done
one 1 1b 1048576 120 24
