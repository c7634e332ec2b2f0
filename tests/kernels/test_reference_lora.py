"""The NumPy LoRA linear (kernels.reference.lora, issue 54) against a float64 transcription:
forward, the adapters' and input's gradients (and central differences of the loss), the merged
weight, PEFT's initialisation, and a few AdamW steps on the adapters alone leaving the frozen
weight bit-identical."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.kernels.reference import adamw_step
from dataflow.kernels.reference.lora import (lora_init, scale, lora_linear_bwd, lora_linear_fwd,
                                             lora_scale, merged_weight)


def _inputs(rng, t=6, n_in=24, n_out=20, rank=4):
    x = rng.standard_normal((t, n_in))
    w = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
    b = rng.standard_normal((n_out, rank)) * 0.1  # trained adapters: b is no longer zero
    return x, w, a, b, lora_scale(16.0, rank)


def test_forward_and_gradients_equal_the_float64_transcription(rng):
    """In float64 the op is the transcription itself: y = x w^T + s x a^T b^T; dx = dy w +
    s dy b a; da = s (dy b)^T x; db = s dy^T (x a^T); each checked against central differences
    of sum(y * g) for a fresh random g."""
    x, w, a, b, s = _inputs(rng)
    g = rng.standard_normal((x.shape[0], w.shape[0]))
    y = lora_linear_fwd(x, w, a, b, s)
    assert np.allclose(y, x @ w.T + s * (x @ a.T) @ b.T, rtol=1e-13, atol=1e-13)
    dx, da, db = lora_linear_bwd(x, w, a, b, s, g)

    def loss(x_, a_, b_):
        return float(np.sum(lora_linear_fwd(x_, w, a_, b_, s) * g))

    h, params = 1e-6, {"x": x, "a": a, "b": b}
    for name, grad in (("x", dx), ("a", da), ("b", db)):
        num = np.zeros_like(params[name])
        for idx in np.ndindex(*num.shape):
            ends = []
            for step in (h, -h):
                moved = dict(params, **{name: params[name].copy()})
                moved[name][idx] += step
                ends.append(loss(moved["x"], moved["a"], moved["b"]))
            num[idx] = (ends[0] - ends[1]) / (2 * h)
        assert np.allclose(grad, num, rtol=1e-6, atol=1e-7), name


def test_fp32_path_is_within_fp32_rounding_of_float64(rng):
    """fp32 inputs: accumulated in fp32, so within a few ulps of the float64 result scaled by
    the magnitudes."""
    x, w, a, b, s = _inputs(rng, t=8, n_in=64, n_out=48, rank=8)
    y64 = lora_linear_fwd(x, w, a, b, s)
    y32 = lora_linear_fwd(*(v.astype(np.float32) for v in (x, w, a, b)), s)
    scale = np.abs(x) @ np.abs(w).T + s * (np.abs(x) @ np.abs(a).T) @ np.abs(b).T
    assert y32.dtype == np.float32
    assert np.all(np.abs(y32 - y64) <= 64 * 2.0 ** -24 * scale + 1e-30)


def test_merged_weight_is_the_same_layer(rng):
    """x @ (w + s b a)^T equals the adapted forward (PEFT's merge_and_unload)."""
    x, w, a, b, s = _inputs(rng)
    assert np.allclose(x @ merged_weight(w, a, b, s).T, lora_linear_fwd(x, w, a, b, s),
                       rtol=1e-12, atol=1e-12)


def test_peft_initialisation_changes_nothing_and_a_is_kaiming_uniform(rng):
    """b starts at zero, so the adapted layer equals the frozen one; a is uniform in
    +-1/sqrt(in_features); a rank below 1 is refused."""
    x, w, _, _, s = _inputs(rng)
    a, b = lora_init(w.shape[1], w.shape[0], 4, rng, np.float64)
    assert not b.any() and np.abs(a).max() <= 1 / np.sqrt(w.shape[1])
    assert np.abs(a).max() > 0.8 / np.sqrt(w.shape[1])
    assert np.array_equal(lora_linear_fwd(x, w, a, b, s), x @ w.T)
    _, da, db = lora_linear_bwd(x, w, a, b, s, rng.standard_normal((x.shape[0], w.shape[0])))
    assert not da.any() and db.any(), "with b = 0 only b learns at the first step, as in PEFT"
    with pytest.raises(ValueError, match="rank must be >= 1"):
        lora_init(8, 8, 0, rng)


def test_adamw_on_the_adapters_moves_the_loss_and_never_the_frozen_weight(rng):
    """Four AdamW steps on a and b alone (fp32 state) fitting a random target: the loss falls,
    and the frozen weight's bits never change (it has no gradient and no optimizer state)."""
    x, w, _, _, s = _inputs(rng, t=32)
    x, w = x.astype(np.float32), w.astype(np.float32)
    a, b = lora_init(w.shape[1], w.shape[0], 4, rng)
    target = rng.standard_normal((x.shape[0], w.shape[0])).astype(np.float32)
    frozen = w.copy()
    state = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in (("a", a), ("b", b))}
    losses = []
    for step in range(1, 5):
        y = lora_linear_fwd(x, w, a, b, s)
        losses.append(float(np.mean((y - target) ** 2)))
        dy = 2 * (y - target) / y.size
        _, da, db = lora_linear_bwd(x, w, a, b, s, dy)
        for name, p, g in (("a", a, da), ("b", b, db)):
            adamw_step(p, g, *state[name], step=step, lr=1e-2)
    assert losses[-1] < losses[0]
    assert np.array_equal(w.view(np.uint32), frozen.view(np.uint32))


def test_scale_rounds_the_fp32_product_once_in_the_inputs_dtype(rng):
    """scale (the engine's scale_ op): x * s in fp32, one rounding to x's dtype (bf16 here),
    so a power-of-two scale is exact and any scale is within one bf16 ulp of float64."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = rng.standard_normal((16, 8)).astype(np.float32).astype(bf16)
    out = scale(x, 0.37)
    assert out.dtype == bf16
    exact = x.astype(np.float64) * 0.37
    assert np.all(np.abs(out.astype(np.float64) - exact) <= np.abs(exact) * 2.0 ** -8 + 1e-30)
    assert np.array_equal(scale(x, 4.0).astype(np.float64), x.astype(np.float64) * 4.0)
