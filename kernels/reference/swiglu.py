"""SwiGLU gate: h = silu(gate) * up, as transformers' LlamaMLP (down(silu(gate(x)) * up(x)))."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)) without overflow and with full relative precision in both tails:
    e = exp(-|z|) never overflows, and for z < 0 the form e / (1 + e) keeps tiny values exact
    where 0.5 * (1 + tanh(z / 2)) cancels to 0 (fp32: below z = -17; wrong by 2e-4 at -10)."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def swiglu_fwd(gate: np.ndarray, up_: np.ndarray) -> np.ndarray:
    """gate (T, F), up (T, F) -> h (T, F) in gate's dtype."""
    dt = acc_dtype(gate, up_)
    g = up(gate, dt)
    return (g * _sigmoid(g) * up(up_, dt)).astype(gate.dtype)


def swiglu_bwd(gate: np.ndarray, up_: np.ndarray,
               dh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gate, up, dh (T, F) -> dgate, dup (T, F) in gate's dtype.

    silu'(g) = s + g s (1 - s) with s = sigmoid(g).
    """
    dt = acc_dtype(gate, up_, dh)
    g, u, d = up(gate, dt), up(up_, dt), up(dh, dt)
    s = _sigmoid(g)
    dgate = d * u * (s + g * s * (1.0 - s))
    dup = d * g * s
    return dgate.astype(gate.dtype), dup.astype(gate.dtype)
