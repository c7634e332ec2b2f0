"""The NumPy FP8 recipe (kernels.reference.fp8, issue 53) against float64: every linear GEMM shape
of the zoo models, forward and both backward GEMMs, within the bound FP8 rounding predicts, and
the scaling's edge cases (zeros, one huge value, inf and NaN).

The bound, per output element, for a product of a (M, K) and b (K, N) quantised with per-element
rounding bounds ea and eb (kernels.reference.fp8.rounding_bound: the format's unit roundoff of
the magnitude, or half a subnormal step below the normal range):
    |fp8 - exact| <= ea @ |b| + |a| @ eb + ea @ eb + gamma_K * (|a| + ea) @ (|b| + eb)
the last term the fp32 accumulation of K products (gamma_K = K u / (1 - K u), u = 2^-24)."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.kernels.reference.fp8 import (E4M3, E5M2, Fp8Tensor, fp8_linear_bwd,
                                            fp8_linear_fwd, fp8_scale, quantise, rounding_bound)
from dataflow.models.config import load_config, zoo_names

TOKENS = 4
"""Rows per GEMM: the bound is per output element, so a few rows test every column's sum."""
COLUMNS = 256
"""The dimension each GEMM does not sum over is cut to this many (the bound and the fp32
accumulation depend on the summed length, which every GEMM keeps whole), so every zoo shape
runs in CI's time."""
CHUNK_TOKENS = 8192
"""The weight gradient sums over a chunk's tokens: 8b's chunk at 8k."""


def _zoo_shapes() -> list[tuple[str, int, int]]:
    """(what, in_features, out_features) of every distinct linear layer of the zoo's blocks:
    q, k/v, o, gate/up, down, and the experts' gate/up and down."""
    shapes = {}
    for name in zoo_names():
        c = load_config(name)
        d, q, kv = c.model_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        pairs = {"q": (d, q), "kv": (d, kv), "o": (q, d), "gate_up": (d, c.ffn_dim),
                 "down": (c.ffn_dim, d)}
        if c.moe is not None:
            f = c.moe.expert_ffn_dim
            pairs |= {"expert_gate_up": (d, f), "expert_down": (f, d)}
        for what, (i, o) in pairs.items():
            shapes.setdefault((i, o), f"{name}.{what}")
    return [(what, i, o) for (i, o), what in sorted(shapes.items())]


def _bound(a, b, ea, eb) -> np.ndarray:
    k = a.shape[1]
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    aa, ab = np.abs(a), np.abs(b)
    return ea @ ab + aa @ eb + ea @ eb + gamma * (aa + ea) @ (ab + eb)


def _check(got, exact, bound, what):
    err = np.abs(got.astype(np.float64) - exact)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: error {worst:.3f}x the FP8 rounding bound"
    # the FP8 rounding really happened: the typical error is of its order, not fp32's
    rel = np.median(err / np.maximum(np.abs(exact), 1e-30))
    assert rel > 1e-4, f"{what}: median relative error {rel:.2e} is too small for FP8"


@pytest.mark.parametrize("what,n_in,n_out", _zoo_shapes(), ids=lambda v: str(v))
def test_fp8_linear_forward_and_input_gradient_stay_within_the_rounding_bound(what, n_in, n_out):
    """y = x @ w.T (E4M3 x E4M3, summing in_features) and dx = dy @ w (E5M2 x E4M3, summing
    out_features) of the shape, on fresh random inputs, against float64 of the unquantised
    inputs."""
    rng = np.random.default_rng([n_in, n_out])
    x = rng.standard_normal((TOKENS, n_in)).astype(np.float32)
    w = (rng.standard_normal((min(n_out, COLUMNS), n_in)) / np.sqrt(n_in)).astype(np.float32)
    y, _, _ = fp8_linear_fwd(x, w)
    assert y.dtype == np.float32
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    _check(y, x64 @ w64.T, _bound(x64, w64.T, rounding_bound(x, E4M3),
                                  rounding_bound(w, E4M3).T), f"{what} forward")

    w = (rng.standard_normal((n_out, min(n_in, COLUMNS))) / np.sqrt(n_in)).astype(np.float32)
    dy = (rng.standard_normal((TOKENS, n_out)) * 1e-3).astype(np.float32)
    qx = quantise(rng.standard_normal((TOKENS, w.shape[1])).astype(np.float32), E4M3)
    dx, _ = fp8_linear_bwd(qx, quantise(w, E4M3), dy)
    w64, dy64 = w.astype(np.float64), dy.astype(np.float64)
    _check(dx, dy64 @ w64, _bound(dy64, w64, rounding_bound(dy, E5M2),
                                  rounding_bound(w, E4M3)), f"{what} dx")


def test_fp8_weight_gradient_over_a_chunk_of_tokens_stays_within_the_rounding_bound():
    """dw = dy.T @ x (E5M2 x E4M3) summed over CHUNK_TOKENS tokens, against float64."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((CHUNK_TOKENS, COLUMNS)).astype(np.float32)
    w = rng.standard_normal((COLUMNS // 2, COLUMNS)).astype(np.float32)
    dy = (rng.standard_normal((CHUNK_TOKENS, COLUMNS // 2)) * 1e-4).astype(np.float32)
    _, qx, qw = fp8_linear_fwd(x, w)
    _, dw = fp8_linear_bwd(qx, qw, dy)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _check(dw, dy64.T @ x64, _bound(dy64.T, x64, rounding_bound(dy, E5M2).T,
                                    rounding_bound(x, E4M3)), "dw")


def test_quantise_uses_a_power_of_two_scale_and_rounds_once():
    """The scale is the power of two bringing amax into [max / 2, max]; the FP8 values are
    exactly ml_dtypes' cast of a * scale; dequantising moves no element by more than
    rounding_bound."""
    rng = np.random.default_rng(7)
    for fmt in (E4M3, E5M2):
        a = (rng.standard_normal(4096) * rng.uniform(1e-3, 1e3)).astype(np.float32)
        q = quantise(a, fmt)
        amax = float(np.abs(a).max())
        assert np.log2(q.scale) == int(np.log2(q.scale))
        assert fmt.max / 2 < amax * q.scale <= fmt.max
        assert np.array_equal(q.values.view(np.uint8),
                              (a * np.float32(q.scale)).astype(fmt.dtype).view(np.uint8))
        assert np.all(np.abs(q.dequantise() - a) <= rounding_bound(a, fmt))


def test_an_all_zero_tensor_has_scale_one_and_gives_zeros():
    x = np.zeros((3, 64), np.float32)
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    y, qx, _ = fp8_linear_fwd(x, w)
    assert qx.scale == 1.0 and not y.any()
    assert fp8_scale(0.0, E5M2) == 1.0


def test_one_huge_value_sets_the_scale_and_the_rest_stays_within_the_bound():
    """A single value 1e6 times the rest: the rest flush towards zero (per-tensor scaling's
    weakness), but never move more than the bound says, and nothing becomes inf or NaN."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(1024).astype(np.float32)
    a[17] = 1e6
    q = quantise(a, E4M3)
    back = q.dequantise()
    assert np.all(np.isfinite(back)) and back[17] == pytest.approx(1e6, rel=2 ** -4)
    assert np.all(np.abs(back - a) <= rounding_bound(a, E4M3))
    assert np.count_nonzero(back[np.arange(1024) != 17] == 0) > 900, "the rest flushed"


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_input_is_refused_naming_the_tensor(bad):
    x = np.ones((2, 16), np.float32)
    w = np.ones((4, 16), np.float32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="activations holds a non-finite value"):
        fp8_linear_fwd(x, w)
    dy = np.ones((2, 4), np.float32)
    dy[0, 0] = bad
    _, qx, qw = fp8_linear_fwd(np.ones((2, 16), np.float32), w)
    with pytest.raises(ValueError, match="output gradients holds a non-finite value"):
        fp8_linear_bwd(qx, qw, dy)


def test_values_at_the_top_of_the_range_never_become_nan():
    """E4M3 has no infinity: a value cast above 448 would be NaN; the power-of-two scale keeps
    amax * scale <= 448, and values that round up to the top stay finite."""
    a = np.array([448.0, -448.0, 447.9, 1.0], np.float32)
    q = quantise(a, E4M3)
    assert q.scale == 1.0 and np.all(np.isfinite(q.values.astype(np.float32)))
    assert isinstance(q, Fp8Tensor)
