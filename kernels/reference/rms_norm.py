"""RMSNorm as transformers' Llama computes it: normalise in fp32, then multiply by the weight."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def rms_norm_fwd(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D), w (D,) -> y (T, D) in x's dtype, rstd (T,) in the acc dtype.

    y = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps).
    """
    dt = acc_dtype(x, w)
    xf = up(x, dt)
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1) + dt.type(eps))
    y = (xf * rstd[:, None]) * up(w, dt)
    return y.astype(x.dtype), rstd.astype(dt)


def rms_norm_bwd(x: np.ndarray, w: np.ndarray, rstd: np.ndarray,
                 dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D), w (D,), rstd (T,), dy (T, D) -> dx (T, D) in x's dtype, dw (D,) acc dtype.

    With n = x * rstd: dw = sum_t dy * n; dx = rstd * (g - n * mean(g * n)) where g = dy * w.
    """
    dt = acc_dtype(x, w, dy)
    xf, dyf, r = up(x, dt), up(dy, dt), up(rstd, dt)[:, None]
    n = xf * r
    dw = np.sum(dyf * n, axis=0)
    g = dyf * up(w, dt)
    dx = r * (g - n * np.mean(g * n, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dw
