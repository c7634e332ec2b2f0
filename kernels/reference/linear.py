"""Linear layer y = x @ w.T (+ b) with w stored [out_features, in_features] as transformers
does; the bias (Qwen2's q/k/v projections) is added in the acc dtype before the one rounding."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def linear_fwd(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """x (T, I), w (O, I), b (O,) or None -> y (T, O) in x's dtype, accumulated in the acc
    dtype (the bias added there too, so y is rounded once)."""
    if b is None:
        dt = acc_dtype(x, w)
        return (up(x, dt) @ up(w, dt).T).astype(x.dtype)
    dt = acc_dtype(x, w, b)
    return (up(x, dt) @ up(w, dt).T + up(b, dt)).astype(x.dtype)


def linear_bwd(x: np.ndarray, w: np.ndarray,
               dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, I), w (O, I), dy (T, O) -> dx (T, I) in x's dtype, dw (O, I) in the acc dtype."""
    dt = acc_dtype(x, w, dy)
    dyf = up(dy, dt)
    dx = (dyf @ up(w, dt)).astype(x.dtype)
    dw = dyf.T @ up(x, dt)
    return dx, dw


def bias_bwd(dy: np.ndarray) -> np.ndarray:
    """dy (T, O) -> db (O,) = sum over the tokens of dy, in the acc dtype."""
    dt = acc_dtype(dy)
    return np.sum(up(dy, dt), axis=0)
