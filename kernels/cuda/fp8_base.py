"""The FP8-stored frozen base's dequantisation on the GPU (kernels/cuda/fp8_base.cu): E4M3 codes
times their row's fp32 scale into a bf16 weight the next base GEMM reads; matches
dataflow.kernels.reference.fp8_base bit for bit. Enqueued on the current CuPy stream; never
synchronises, never allocates."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32

_SRC = "fp8_base.cu"
_NAMES = ("fp8_base_dequant_kernel<1>", "fp8_base_dequant_kernel<4>")
_THREADS = 256
U8 = np.dtype(np.uint8)


def fp8_base_dequant(ctx, codes, scales, out) -> None:
    """codes (O, I) uint8 (E4M3 bits), scales (O,) fp32 -> out (O, I) bf16 = codes * scale."""
    _build.check("codes", codes, None, (U8,))
    rows, cols = codes.shape
    _build.check("scales", scales, (rows,), (F32,))
    _build.check("out", out, (rows, cols), (BF16,))
    n = rows * cols
    if not n:
        return
    vec = 4 if cols % 4 == 0 and codes.data.ptr % 4 == 0 and out.data.ptr % 8 == 0 else 1
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_base_dequant_kernel<{vec}>")(
        (_build.flat_grid(ctx, n // vec, _THREADS),), (_THREADS,),
        (codes, scales, out, np.int64(rows), np.int64(cols)))
