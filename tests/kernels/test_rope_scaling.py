"""Llama 3.1-style RoPE scaling ('llama3'): the inverse frequencies equal a hand transcription of
transformers' `_compute_llama3_parameters` on real and small configs, plain RoPE is unchanged bit
for bit, and the reference model's forward with scaling equals a direct float64 NumPy Llama."""

import dataclasses
import math

import numpy as np
import pytest

from dataflow.reference_model import forward_backward
from dataflow.rope import rope_table
from dataflow.kernels.reference import rope_bwd, rope_fwd, rope_inv_freq
from dataflow.models.config import RopeScaling, load_config
from dataflow.models.init import BF16, init_model
from dataflow.models.layout import layer_layout
from tests.llama_float64 import llama_loss_float64

# (head_dim, theta, (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings))
CONFIGS = {
    "llama3.1-8b": (128, 500000.0, (8.0, 1.0, 4.0, 8192)),
    "llama3.2-1b": (64, 500000.0, (32.0, 1.0, 4.0, 8192)),
    "small-all-regimes": (16, 10000.0, (4.0, 1.0, 4.0, 256)),
    "odd-factors": (32, 50000.0, (3.0, 0.5, 2.5, 1000)),
}


def transformers_llama3_inv_freq(head_dim, theta, scaling, dtype=np.float64):
    """transformers' _compute_default_rope_parameters + _compute_llama3_parameters written out
    element by element in `dtype` (float32 is what transformers computes in)."""
    factor, low, high, old = (dtype(v) for v in scaling)
    out = []
    for i in range(0, head_dim, 2):
        inv = dtype(1.0) / dtype(theta) ** (dtype(i) / dtype(head_dim))
        wavelen = dtype(2 * math.pi) / inv
        if wavelen < old / high:
            new = inv
        elif wavelen > old / low:
            new = inv / factor
        else:
            smooth = (old / wavelen - low) / (high - low)
            new = (dtype(1) - smooth) * inv / factor + smooth * inv
        out.append(new)
    return np.array(out, dtype=dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama3_inverse_frequencies_match_transformers_formula(name):
    """rope_inv_freq with llama3 scaling equals the transcription in float64 to a few ulps and
    transformers' own float32 arithmetic to float32 rounding."""
    head_dim, theta, scaling = CONFIGS[name]
    got = rope_inv_freq(head_dim, theta, scaling)
    assert got.dtype == np.float64 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, transformers_llama3_inv_freq(head_dim, theta, scaling),
                               rtol=1e-15, atol=0)
    np.testing.assert_allclose(got, transformers_llama3_inv_freq(head_dim, theta, scaling,
                                                                 np.float32), rtol=2e-6, atol=0)


def test_small_config_exercises_all_three_regimes():
    """The small test config keeps some frequencies, divides some by factor and interpolates
    at least one, so the tests above check every branch of the formula."""
    head_dim, theta, scaling = CONFIGS["small-all-regimes"]
    plain = rope_inv_freq(head_dim, theta)
    ratio = rope_inv_freq(head_dim, theta, scaling) / plain
    kept, divided = ratio == 1.0, np.isclose(ratio, 1 / scaling[0], rtol=1e-15)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_plain_table_is_the_previous_formula_bit_for_bit(rng):
    """Without scaling the table is exactly theta ** (-2j/E) as before, and rope_fwd/rope_bwd
    given the table equal the same ops given theta, bit for bit, in bf16 and fp32."""
    e, theta = 64, 500000.0
    table = rope_inv_freq(e, theta)
    assert np.array_equal(table, float(theta) ** (-2.0 * np.arange(e // 2, dtype=np.float64) / e))
    pos = rng.integers(0, 1 << 20, size=9)
    for dt in (BF16, np.float32):
        x = rng.standard_normal((9, 3, e)).astype(dt)
        for fn in (rope_fwd, rope_bwd):
            assert np.array_equal(fn(x, pos, table).view(np.uint8),
                                  fn(x, pos, theta).view(np.uint8))


def test_rope_table_of_a_config_is_cached_read_only_and_scaled():
    """dataflow.rope.rope_table gives the config's table once (same object each call), read-only,
    equal to rope_inv_freq with the config's scaling; plain configs get the plain table."""
    cfg = load_config("tiny")
    scaled = dataclasses.replace(cfg, rope_scaling=RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256))
    t = rope_table(scaled)
    assert t is rope_table(scaled) and not t.flags.writeable
    assert np.array_equal(t, rope_inv_freq(16, 10000.0, (4.0, 1.0, 4.0, 256)))
    assert np.array_equal(rope_table(cfg), rope_inv_freq(16, 10000.0))
    assert not np.array_equal(rope_table(cfg), t)


def test_rope_refuses_a_table_of_the_wrong_length(rng):
    """A table that does not have E/2 entries is refused, naming both shapes."""
    x = rng.standard_normal((2, 1, 8))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        rope_fwd(x, np.arange(2), np.ones(8))


def test_reference_forward_with_llama3_scaling_equals_direct_float64_llama(rng):
    """The reference model's float64 loss on a scaled tiny config equals a direct transcription
    using transformers' scaled frequencies to 1e-12, and differs from the plain-RoPE loss by far
    more (the scaling reaches attention)."""
    head_dim, theta, scaling = CONFIGS["small-all-regimes"]
    cfg = dataclasses.replace(load_config("tiny"), rope_scaling=RopeScaling(
        factor=scaling[0], low_freq_factor=scaling[1], high_freq_factor=scaling[2],
        original_max_position_embeddings=scaling[3]))
    assert (cfg.head_dim, cfg.rope_theta) == (head_dim, theta)
    wb = init_model(cfg, int(rng.integers(0, 2**31)))
    w = type("W", (), {"embed": wb.embed.astype(np.float64),
                       "layers": [b.astype(np.float64) for b in wb.layers],
                       "head": wb.head.astype(np.float64)})()
    # Large q/k projections and long positions make attention depend strongly on the angles.
    for block in w.layers:
        for name in ("self_attn.q_proj", "self_attn.k_proj"):
            layer_layout(cfg).view(block, name)[...] *= 8.0
    tokens = rng.integers(0, cfg.vocab_size, size=129)
    loss, n, _ = forward_backward(cfg, w, tokens)
    assert n == 128
    direct = llama_loss_float64(cfg, w, tokens, transformers_llama3_inv_freq(head_dim, theta,
                                                                             scaling))
    assert abs(loss - direct) <= 1e-12 * abs(direct)
    plain = llama_loss_float64(cfg, w, tokens, 1.0 / theta ** (np.arange(0, head_dim, 2)
                                                                / head_dim))
    # far above float64 rounding (1e-12); 1e-4 failed for one seed in 25 (4.5e-5 relative:
    # the scaling moves only the low frequencies, whose effect depends on the random weights)
    assert abs(plain - direct) > 1e-6 * abs(direct)
