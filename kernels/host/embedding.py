"""Embedding backward on the CPU: scatter-add the first layer's input gradient into the home
embedding gradient, in parallel over distinct token ids. Each row's contributions are summed in
fp32 in token order and added to the stored row once, exactly as dataflow.ops_numpy does, so
the result is bit-identical to the NumPy device path."""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from dataflow.kernels.host._bf16 import bf16_to_f32, f32_to_bf16


def _add(row, acc):
    """row + acc (fp32) in the row's own storage: bf16 bits (uint16) or fp32."""
    raise NotImplementedError("only called from numba-compiled code")


@overload(_add)
def _add_impl(row, acc):
    # chosen by the table's type at compile time: no function argument, so numba's disk cache
    # hits (a function argument made every process recompile _scatter)
    if row.dtype == types.uint16:
        return lambda row, acc: f32_to_bf16(bf16_to_f32(row) + acc)
    return lambda row, acc: row + acc


@numba.njit(parallel=True, cache=True)
def _scatter(order, starts, ids_sorted, dx, table):
    for u in numba.prange(starts.size - 1):
        row = ids_sorted[starts[u]]
        acc = np.zeros(dx.shape[1], dtype=np.float32)
        for j in range(starts[u], starts[u + 1]):
            acc += bf16_to_f32(dx[order[j]])
        table[row] = _add(table[row], acc)


def embedding_bwd(ids: np.ndarray, dx: np.ndarray, dtable: np.ndarray) -> None:
    """ids (T,) int; dx (T, D) bf16; dtable (V, D) bf16 or fp32, accumulated in place."""
    ids = np.asarray(ids)
    order = np.argsort(ids, kind="stable")
    ids_sorted = ids[order]
    starts = np.flatnonzero(np.r_[True, ids_sorted[1:] != ids_sorted[:-1], True]).astype(np.int64)
    dx16 = dx.view(np.uint16)
    if dtable.dtype == np.float32:
        _scatter(order, starts, ids_sorted, dx16, dtable)
    else:
        _scatter(order, starts, ids_sorted, dx16, dtable.view(np.uint16))
