"""RoPE convention and precision: the reference rotates dimension j with j + E/2 as transformers'
Llama does (`rotate_half`), with inverse frequencies theta ** (-2j / E), and keeps its phase at
positions around a million (angles formed in float64)."""

import numpy as np

from dataflow.kernels.reference import rope_bwd, rope_fwd

FP32_UNIT_ROUNDOFF = 2.0**-24


def transformers_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, transcribed to float64 NumPy:
    emb = cat(freqs, freqs); q_embed = q * cos + rotate_half(q) * sin."""
    e = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    freqs = np.outer(positions.astype(np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # (T, 1, E), broadcast on heads
    rotate_half = np.concatenate([-x[..., e // 2:], x[..., : e // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def test_rope_rotates_dimension_j_with_j_plus_half_on_a_hand_made_example():
    """At position 2 with E = 4 and theta = 100, dims (0, 2) turn by 2 rad and dims (1, 3) by
    2 * 100**(-1/2) = 0.2 rad, as transformers' rotate_half pairs them."""
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])  # (T=1, heads=1, E=4)
    y = rope_fwd(x, np.array([2]), 100.0)
    c2, s2, c02, s02 = np.cos(2.0), np.sin(2.0), np.cos(0.2), np.sin(0.2)
    by_hand = np.array([1 * c2 - 3 * s2,     # y0 = x0 cos(a0) - x2 sin(a0)
                        2 * c02 - 4 * s02,   # y1 = x1 cos(a1) - x3 sin(a1)
                        3 * c2 + 1 * s2,     # y2 = x2 cos(a0) + x0 sin(a0)
                        4 * c02 + 2 * s02])  # y3 = x3 cos(a1) + x1 sin(a1)
    np.testing.assert_allclose(y[0, 0], by_hand, rtol=1e-14)
    interleaved = np.array([1 * c2 - 2 * s2, 2 * c2 + 1 * s2, 3 * c02 - 4 * s02, 4 * c02 + 3 * s02])
    assert not np.allclose(y[0, 0], interleaved), "must not be Meta's interleaved pairing"


def test_rope_matches_transformers_rotate_half_on_random_input(rng):
    """On random float64 input with several heads the reference equals transformers' formula."""
    x = rng.standard_normal((7, 3, 16))
    positions = rng.integers(0, 10_000, size=7)
    np.testing.assert_allclose(rope_fwd(x, positions, 5e5),
                               transformers_rope(x, positions, 5e5), rtol=1e-12, atol=1e-12)


def test_rope_at_position_zero_is_identity_and_rotation_keeps_pair_norms(rng):
    """Position 0 leaves x unchanged, and every position preserves the norm of each (j, j+E/2)
    pair; the backward rotates back."""
    x = rng.standard_normal((5, 2, 8))
    positions = np.array([0, 1, 17, 4096, 123_457])
    y = rope_fwd(x, positions, 10_000.0)
    np.testing.assert_array_equal(y[0], x[0])
    pair_norm = lambda a: a[..., :4] ** 2 + a[..., 4:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(y), pair_norm(x), rtol=1e-12)
    np.testing.assert_allclose(rope_bwd(y, positions, 10_000.0), x, rtol=1e-12, atol=1e-12)


def test_rope_in_fp32_at_positions_near_a_million_matches_float64(rng):
    """fp32 RoPE at positions ~1e6 (theta 5e5, E 128) stays within a few fp32 roundings of the
    float64 result; forming the angle in fp32 (ulp(1e6) = 1/16 rad) would not."""
    t, heads, e, theta = 16, 2, 128, 5e5
    x32 = rng.standard_normal((t, heads, e)).astype(np.float32)
    positions = 1_000_000 + rng.integers(-1000, 1000, size=t)
    y32 = rope_fwd(x32, positions, theta)
    assert y32.dtype == np.float32
    y64 = transformers_rope(x32.astype(np.float64), positions, theta)
    # Per element: cos/sin rounded (u each), two products and one sum rounded (u each), so the
    # error is at most ~3u (|x_j| + |x_{j+E/2}|); 4u leaves a margin.
    pair_mag = np.abs(x32[..., : e // 2]) + np.abs(x32[..., e // 2:])
    bound = 4 * FP32_UNIT_ROUNDOFF * np.concatenate([pair_mag, pair_mag], axis=-1)
    assert np.all(np.abs(y32 - y64) <= bound)
    # The same rotation with the angle formed in fp32 breaks that bound: the check has teeth.
    inv_freq = (np.float32(theta) ** (-2 * np.arange(e // 2, dtype=np.float32) / e))
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x32[..., : e // 2], x32[..., e // 2:]
    naive = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    assert np.any(np.abs(naive - y64) > bound)
