#!/usr/bin/env bash
# Twenty-sixth session, call 1 (one H200): why the cuBLASLt FP8 GEMM refused (probe with
# cuBLASLt's own log), the FP8 kernel tests, the CuPy FP8 linear ops, bench.fp8_gemm.
set -uo pipefail
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
CUBLASLT_LOG_MASK=31 CUBLASLT_LOG_FILE=$OUT/lt_probe.log timeout 120 python3 -m dataflow.bench.fp8_gemm_probe > $OUT/probe.log 2>&1
echo "probe rc $? at $((SECONDS-T0)) s"; cat $OUT/probe.log | cut -c1-200
grep -iE "error|not supported|fail|reason" $OUT/lt_probe.log | head -20 | cut -c1-300
CUBLASLT_LOG_MASK=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_fp8_cuda.py > $OUT/t_kern.log 2>&1
echo "kernel tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_kern.log | head -12 | cut -c1-220
DATAFLOW_FP8_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dataflow/test_gpu_precision_fp8.py > $OUT/t_ops.log 2>&1
echo "op tests rc $? at $((SECONDS-T0)) s"; grep -E "passed|failed|^FAILED|^E " $OUT/t_ops.log | head -12 | cut -c1-220
timeout $((540 - (SECONDS - T0))) python3 -m dataflow.bench.fp8_gemm --out $OUT/fp8_gemm.json > $OUT/bench.log 2>&1
echo "bench rc $? at $((SECONDS-T0)) s"; tail -25 $OUT/bench.log | cut -c1-200
