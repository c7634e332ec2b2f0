"""Rotary position embedding, half-split convention of transformers' Llama (`rotate_half`):
dimension j is paired with j + E/2 and rotated by the angle pos * inv_freq[j], j < E/2.
`rope_inv_freq` is the one definition of the inverse frequencies (plain theta ** (-2j / E), or
Llama 3.1-style scaled as transformers' `_compute_llama3_parameters` does); the NumPy and CUDA
ops both take its table. Everything is formed in float64 (angles are exact for positions up to
2^53) and cos/sin rounded to the acc dtype, so long contexts do not lose phase."""

import math

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def rope_inv_freq(head_dim: int, theta: float, llama3=None) -> np.ndarray:
    """Inverse frequencies (E/2,) float64 for RoPE base `theta`.

    llama3: None for plain RoPE (theta ** (-2j / E)), or the numbers
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of a
    Llama 3.1/3.2 `rope_scaling`: transformers' `_compute_llama3_parameters`, step for step
    but in float64 (transformers works in float32; the two agree to float32 rounding).
    """
    half = head_dim // 2
    inv_freq = float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = (float(v) for v in llama3)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept ...
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # ... and those in between interpolated; continuous at both ends, so a wavelength that
    # lands on a threshold gives the same value from either branch (up to rounding).
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _table(inv_freq, head_dim: int) -> np.ndarray:
    """inv_freq as an (E/2,) float64 array; a number is taken as plain RoPE's theta."""
    if np.ndim(inv_freq) == 0:
        return rope_inv_freq(head_dim, float(inv_freq))
    table = np.asarray(inv_freq, dtype=np.float64)
    if table.shape != (head_dim // 2,):
        raise ValueError(f"rope inv_freq has shape {table.shape}, head_dim {head_dim} needs "
                         f"({head_dim // 2},); build it with rope_inv_freq")
    return table


def rope_cos_sin(positions: np.ndarray, head_dim: int, inv_freq,
                 dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """positions (T,) int, inv_freq (E/2,) float64 (or plain RoPE's theta) -> cos, sin
    (T, E/2) in `dtype`."""
    table = _table(inv_freq, head_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * table[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rope_fwd(x: np.ndarray, positions: np.ndarray, inv_freq) -> np.ndarray:
    """x (T, n_heads, E), positions (T,), inv_freq (E/2,) float64 from rope_inv_freq (or a
    number: plain RoPE's theta) -> y (T, n_heads, E) in x's dtype.

    y1 = x1 cos - x2 sin; y2 = x2 cos + x1 sin, with x1 = x[..., :E/2], x2 = x[..., E/2:].
    """
    dt = acc_dtype(x)
    cos, sin = rope_cos_sin(positions, x.shape[-1], inv_freq, dt)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = up(x, dt)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_bwd(dy: np.ndarray, positions: np.ndarray, inv_freq) -> np.ndarray:
    """dy (T, n_heads, E) -> dx (T, n_heads, E): the transpose of the rotation (angle -> -angle).
    inv_freq as for rope_fwd."""
    dt = acc_dtype(dy)
    cos, sin = rope_cos_sin(positions, dy.shape[-1], inv_freq, dt)
    cos, sin = cos[:, None, :], sin[:, None, :]
    g = up(dy, dt)
    half = dy.shape[-1] // 2
    g1, g2 = g[..., :half], g[..., half:]
    return np.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], axis=-1).astype(dy.dtype)
