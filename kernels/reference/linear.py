"""Linear layer y = x @ w.T with w stored [out_features, in_features] as transformers does."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def linear_fwd(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, I), w (O, I) -> y (T, O) in x's dtype, accumulated in the acc dtype."""
    dt = acc_dtype(x, w)
    return (up(x, dt) @ up(w, dt).T).astype(x.dtype)


def linear_bwd(x: np.ndarray, w: np.ndarray,
               dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, I), w (O, I), dy (T, O) -> dx (T, I) in x's dtype, dw (O, I) in the acc dtype."""
    dt = acc_dtype(x, w, dy)
    dyf = up(dy, dt)
    dx = (dyf @ up(w, dt)).astype(x.dtype)
    dw = dyf.T @ up(x, dt)
    return dx, dw
