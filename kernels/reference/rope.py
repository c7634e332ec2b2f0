"""Rotary position embedding, half-split convention of transformers' Llama (`rotate_half`):
dimension j is paired with j + E/2, inverse frequency theta ** (-2j / E) for j < E/2.
Angles are formed in float64 (exact for positions up to 2^53) and cos/sin rounded to the acc
dtype, so long contexts do not lose phase."""

import numpy as np

from kernels.reference._dtypes import acc_dtype, up


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float,
                 dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """positions (T,) int -> cos, sin (T, E/2) in `dtype`."""
    half = head_dim // 2
    inv_freq = float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / head_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rope_fwd(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x (T, n_heads, E), positions (T,) -> y (T, n_heads, E) in x's dtype.

    y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin, with x1 = x[..., :E/2], x2 = x[..., E/2:].
    """
    dt = acc_dtype(x)
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, dt)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = up(x, dt)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_bwd(dy: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """dy (T, n_heads, E) -> dx (T, n_heads, E): the transpose of the rotation (angle -> -angle)."""
    dt = acc_dtype(dy)
    cos, sin = rope_cos_sin(positions, dy.shape[-1], theta, dt)
    cos, sin = cos[:, None, :], sin[:, None, :]
    g = up(dy, dt)
    half = dy.shape[-1] // 2
    g1, g2 = g[..., :half], g[..., half:]
    return np.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], axis=-1).astype(dy.dtype)
