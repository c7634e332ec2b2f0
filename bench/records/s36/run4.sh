#!/usr/bin/env bash
# Thirty-sixth session, last call (little budget left): the grouped-GEMM test and the probe only.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 8192 --repeat 3 --out $OUT/grouped-olmoe-8k.json 2>&1 | tail -14
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cublaslt.py -k grouped 2>&1 | tail -3
