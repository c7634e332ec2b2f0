"""bf16 <-> fp32 on uint16 bit patterns inside numba kernels (round to nearest even, NaN kept)."""

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@numba.njit(cache=True, inline="always")
def f32_to_bf16(x):
    b = x.view(np.uint32)
    one, sixteen = np.uint32(1), np.uint32(16)
    out = ((b + np.uint32(0x7FFF) + ((b >> sixteen) & one)) >> sixteen).astype(np.uint16)
    out[x != x] = np.uint16(0x7FC0)
    return out
