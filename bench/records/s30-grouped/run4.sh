#!/usr/bin/env bash
# Thirtieth session, call 4: the GPU test suite on the merged tree (split updates, the fp8 base,
# the grouped MoE path and its planner choice), as far as the call's time allows.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
timeout 400 python3 -m pytest -q -m gpu -rfE -p no:cacheprovider tests/dataflow tests/kernels 2>&1 | tee $OUT/gpu-tests.log | tail -40
