"""Dtype policy shared by the reference ops: compute in fp32 unless an input is float64."""

import numpy as np


def acc_dtype(*arrays) -> np.dtype:
    """float64 when any input is float64 (gradient checks), else float32."""
    if any(np.asarray(a).dtype == np.float64 for a in arrays):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def up(a, dtype) -> np.ndarray:
    """`a` as `dtype` (a copy only when the dtype differs)."""
    return np.asarray(a).astype(dtype, copy=False)
