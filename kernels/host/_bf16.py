"""bf16 <-> fp32 on uint16 bit patterns inside numba kernels (round to nearest even, NaN kept),
and as_f32 for kernels that take either."""

import numba
import numpy as np
from numba import types
from numba.extending import overload


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


def as_f32(x):
    """x as fp32 inside numba code: bf16 bits (uint16) unpacked, fp32 as it is (no copy)."""
    raise NotImplementedError("only called from numba-compiled code")


@overload(as_f32)
def _as_f32_impl(x):
    # chosen by the array's type at compile time, so a kernel takes no function argument and
    # numba's disk cache holds one entry per dtype (a function argument defeated the cache:
    # every process recompiled, 16-22 s on two cores)
    if x.dtype == types.uint16:
        return lambda x: bf16_to_f32(x)
    return lambda x: x
