"""Squared L2 norm of a bf16 (uint16 bit patterns) or fp32 host array, in parallel: the host's part
of the global gradient norm when the embedding's gradient accumulates at home. float64 partial
sums per piece (four interleaved accumulators), added in a fixed order, rounded once to fp32
(the same contract as the NumPy op table's sumsq). Never allocates more than the per-piece
partial sums (and, for bf16, each piece unpacked to fp32)."""

from __future__ import annotations

import numba
import numpy as np

from dataflow.kernels.host._bf16 import as_f32

_PIECE = 1 << 20


@numba.njit(parallel=True, cache=True)
def _sumsq(x):
    n = x.size
    pieces = (n + _PIECE - 1) // _PIECE
    part = np.zeros(pieces, dtype=np.float64)
    for k in numba.prange(pieces):
        a = k * _PIECE
        z = min(n, a + _PIECE)
        y = as_f32(x[a:z])
        # four interleaved accumulators: one float64 add chain ran at about 1 G elements/s a
        # core (the add's latency), 2.1 GB of 8b's fp32 embedding gradient in 111 ms on 16
        # cores at the end of every step (bench/records/s40/call3/); four ran 2x on two cores
        m = (z - a) // 4 * 4
        a0 = a1 = a2 = a3 = 0.0
        for i in range(0, m, 4):
            v0, v1 = np.float64(y[i]), np.float64(y[i + 1])
            v2, v3 = np.float64(y[i + 2]), np.float64(y[i + 3])
            a0 += v0 * v0
            a1 += v1 * v1
            a2 += v2 * v2
            a3 += v3 * v3
        for i in range(m, z - a):
            v = np.float64(y[i])
            a0 += v * v
        part[k] = (a0 + a1) + (a2 + a3)
    return part.sum()


def sumsq(x: np.ndarray) -> float:
    """sum(x ** 2) of a 1-D bf16 or fp32 array, in float64."""
    flat = x.reshape(-1)
    if flat.dtype == np.float32:
        return float(_sumsq(flat))
    if flat.dtype.itemsize != 2:
        raise TypeError(f"sumsq takes bf16 or fp32, got {flat.dtype}")
    return float(_sumsq(flat.view(np.uint16)))


def sumsq_into(x: np.ndarray, out: np.ndarray) -> None:
    """out[0] = float32(sum(x ** 2))."""
    out[0] = np.float32(sumsq(x))
