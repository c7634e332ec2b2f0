"""Squared L2 norm of a bf16 (uint16 bit patterns) or fp32 host array, in parallel: the host's part
of the global gradient norm when the embedding's gradient accumulates at home. float64 partial
sums per piece (four interleaved accumulators), added in a fixed order, rounded once to fp32
(the same contract as the NumPy op table's sumsq). Never allocates more than the per-piece
partial sums."""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

_PIECE = 1 << 20

with np.errstate(invalid="ignore"):  # the NaN patterns
    BF16_SQUARES = ((np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)
                    .astype(np.float64)) ** 2
"""Every bf16 bit pattern's value squared in float64 (exact: 8 significant bits squared), NaN and
inf as squaring gives them: 512 KiB, read from cache. Unpacking each piece to fp32 first
allocated inside the parallel loop and ran at 0.6 GB/s on two cores, 9.5 GB/s on the GPU
machine's sixteen (8b's bf16 embedding gradient, 1.05 GB, in 111 ms at the end of every step:
bench/records/s40/call3/); the table runs 10x that on two cores."""


def _square(x, i, table):
    """x[i] squared in float64 inside numba code: by the table for bf16 bits, else by multiplying."""
    raise NotImplementedError("only called from numba-compiled code")


@overload(_square, inline="always")
def _square_impl(x, i, table):
    # chosen by the array's type at compile time (as _bf16.as_f32): one cache entry per dtype
    if x.dtype == types.uint16:
        return lambda x, i, table: table[x[i]]
    return lambda x, i, table: np.float64(x[i]) * np.float64(x[i])


@numba.njit(parallel=True, cache=True)
def _sumsq(x, table):
    """x: fp32 values (table empty) or bf16 bit patterns indexing `table`."""
    n = x.size
    pieces = (n + _PIECE - 1) // _PIECE
    part = np.zeros(pieces, dtype=np.float64)
    for k in numba.prange(pieces):
        a = k * _PIECE
        z = min(n, a + _PIECE)
        # four interleaved accumulators: one float64 add chain is bound by the add's latency
        # (7.7 -> 21.8 GB/s of fp32 on two cores)
        m = a + (z - a) // 4 * 4
        a0 = a1 = a2 = a3 = 0.0
        for i in range(a, m, 4):
            a0 += _square(x, i, table)
            a1 += _square(x, i + 1, table)
            a2 += _square(x, i + 2, table)
            a3 += _square(x, i + 3, table)
        for i in range(m, z):
            a0 += _square(x, i, table)
        part[k] = (a0 + a1) + (a2 + a3)
    return part.sum()


_NO_TABLE = np.zeros(0, np.float64)


def sumsq(x: np.ndarray) -> float:
    """sum(x ** 2) of a 1-D bf16 or fp32 array, in float64."""
    flat = x.reshape(-1)
    if flat.dtype == np.float32:
        return float(_sumsq(flat, _NO_TABLE))
    if flat.dtype.itemsize != 2:
        raise TypeError(f"sumsq takes bf16 or fp32, got {flat.dtype}")
    return float(_sumsq(flat.view(np.uint16), BF16_SQUARES))


def sumsq_into(x: np.ndarray, out: np.ndarray) -> None:
    """out[0] = float32(sum(x ** 2))."""
    out[0] = np.float32(sumsq(x))
