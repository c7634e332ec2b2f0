"""The FP8-stored frozen base's dequantisation (`--lora-base fp8`, docs/lora.md), in NumPy: the
definition the CUDA kernel (kernels/cuda/fp8_base.cu) must match bit for bit. Never imports
anything of ours but this package.

w (O, I) bf16 = bf16(float(e4m3(codes)) * scales[row]): the E4M3 decode is exact, the product is
one fp32 multiply, rounded once to bf16 (nearest even)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)


def fp8_base_dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes (O, I) uint8 (E4M3 bits), scales (O,) fp32 -> w (O, I) bf16."""
    x = np.asarray(codes).view(E4M3).astype(np.float32)
    return (x * np.asarray(scales, np.float32).reshape(-1, 1)).astype(BF16)
