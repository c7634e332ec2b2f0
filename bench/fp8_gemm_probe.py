"""Which cuBLASLt FP8 GEMM configurations the current GPU and cuBLAS accept: a diagnostic for
kernels/cuda/fp8_gemm.py (issue 53; on the H200 of the twenty-fifth session its first call
returned CUBLAS_STATUS_NOT_SUPPORTED (15) after the heuristic had found an algorithm, and no
device time was left to find out why). Each row builds one descriptor (scale pointers set or
not, at an aligned or a 4-byte-offset address; FAST_ACCUM set or not; D bf16 or fp32; with or
without a workspace) for a 512 x 1024 x 4096 E4M3 GEMM and prints what the heuristic and the
matmul return. Run with CUBLASLT_LOG_MASK=5 for cuBLASLt's own reasons.

    python -m dataflow.bench.fp8_gemm_probe
"""

from __future__ import annotations

import sys

def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    # Imported here: --help and the test collection must work without CuPy.
    import dataflow.kernels.cuda as kc
    from dataflow.kernels.cuda.fp8_gemm import probe  # needs CuPy, as above

    del argv
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    print(f"{'D':5} {'scales':7} {'offset':>6} {'fast':5} {'workspace':>10} | result")
    for (d_name, scales, offset, fast, ws), out in probe(kc.CudaContext()):
        print(f"{d_name:5} {str(scales):7} {offset:6} {str(fast):5} {ws:10} | {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
