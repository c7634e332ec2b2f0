"""A linear layer with a LoRA adapter, in NumPy: the definition the engine's LoRA path is to be
checked against (issue 54). Never imports anything of ours but this package.

y = x @ w.T + s * (x @ a.T) @ b.T, with the frozen weight w (O, I), the adapter a (r, I) and
b (O, r), and s = alpha / r (PEFT's LoraLayer scaling; dropout 0). The backward gives the input
gradient and the adapters' gradients only: the frozen weight gets none, so no weight-gradient
GEMM of w's size runs and nothing of w's size is written. Initialised as PEFT does: a from
kaiming_uniform_(a=sqrt(5)) (uniform in +-1/sqrt(I)), b zeros, so a fresh adapter changes nothing.
Accumulation and dtypes as kernels.reference.linear (fp32 unless an input is float64)."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def lora_init(n_in: int, n_out: int, rank: int, rng: np.random.Generator,
              dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(a (rank, n_in), b (n_out, rank)) as PEFT initialises them."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    bound = 1.0 / np.sqrt(n_in)
    return (rng.uniform(-bound, bound, (rank, n_in)).astype(dtype),
            np.zeros((n_out, rank), dtype))


def lora_scale(alpha: float, rank: int) -> float:
    """PEFT's scaling: alpha / rank (rsLoRA's alpha / sqrt(rank) is not this)."""
    return alpha / rank


def scale(x: np.ndarray, s: float) -> np.ndarray:
    """x * s in fp32, rounded once to x's dtype: the adapters' (T, r) intermediates scaled by
    alpha / r in place (the engine's scale_ op)."""
    return (x.astype(np.float32) * np.float32(s)).astype(x.dtype)


def lora_linear_fwd(x: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray,
                    scale: float) -> np.ndarray:
    """x (T, I) -> y (T, O) in x's dtype, rounded once."""
    dt = acc_dtype(x, w, a, b)
    xf = up(x, dt)
    return (xf @ up(w, dt).T + dt.type(scale) * ((xf @ up(a, dt).T) @ up(b, dt).T)).astype(
        x.dtype)


def lora_linear_bwd(x: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                    dy: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (dx (T, I) in x's dtype, da (r, I), db (O, r) in the acc dtype); w gets no gradient."""
    dt = acc_dtype(x, w, a, b, dy)
    xf, dyf, af, bf = up(x, dt), up(dy, dt), up(a, dt), up(b, dt)
    s = dt.type(scale)
    dy_b = dyf @ bf                      # (T, r)
    dx = (dyf @ up(w, dt) + s * (dy_b @ af)).astype(x.dtype)
    da = s * (dy_b.T @ xf)               # (r, I)
    db = s * (dyf.T @ (xf @ af.T))       # (O, r)
    return dx, da, db


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """w + s * b @ a in w's dtype: the layer as one linear (PEFT's merge_and_unload)."""
    dt = acc_dtype(w, a, b)
    return (up(w, dt) + dt.type(scale) * (up(b, dt) @ up(a, dt))).astype(w.dtype)
