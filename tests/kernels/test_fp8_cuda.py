"""The FP8 GPU path (kernels/cuda/fp8.py, fp8_gemm.py) against the recipe's NumPy reference
(kernels/reference/fp8.py) on fresh random inputs: the quantised bytes, their transposes and the
scales equal the reference's exactly; the GEMMs equal the exact product of the same FP8 values
(float64, scaled once) within the rounding of their output and fp32 accumulation; a linear
layer's three GEMMs (y = x w^T in E4M3, dx = dy w and dw = dy^T x with dy in E5M2) within the
reference's own bound against float64 of the unquantised inputs. Edge cases: an all-zero tensor
(scale 1), a non-finite one (NaN scales: it poisons what it touches, so the step is seen as
non-finite), E5M2 x E5M2 and sizes that are not multiples of 16 refused. GPU only (sm_89+)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dataflow.kernels.reference import fp8 as ref
from tests.gpu import BF16, F32, bf, cuda_context, dev, host, require_gpu

cp = require_gpu()
if int(cp.cuda.Device().compute_capability) < 89:
    pytest.skip("FP8 needs sm_89+", allow_module_level=True)

# Imported after the GPU check: the package needs CuPy.
import dataflow.kernels.cuda as kc  # noqa: E402

pytestmark = pytest.mark.gpu
CTX = cuda_context()
FORMATS = {"e4m3": ref.E4M3, "e5m2": ref.E5M2}


def _quantise(x, fmt, transpose=True):
    xd = dev(x)
    scales = cp.full(3, np.nan, F32)
    out = cp.full(x.shape, 0xAB, np.uint8)
    out_t = cp.full(x.shape[::-1], 0xAB, np.uint8) if transpose else None
    kc.fp8_quantise(CTX, xd, fmt, scales, out, out_t)
    return scales, out, out_t


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(256, 4096), (80, 1040), (4112, 48)])
def test_quantise_equals_the_reference_byte_for_byte(rng, dtype, fmt, shape):
    """Sizes off the 64-wide tile, a wide range of magnitudes (so some values are subnormal in
    FP8 and some saturate at the scale's edge), bf16 and fp32 inputs."""
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape))).astype(F32)
    x = x.astype(dtype)
    want = ref.quantise(x, FORMATS[fmt])
    scales, out, out_t = _quantise(x, fmt)
    s = cp.asnumpy(scales)
    assert s[1] == np.float32(want.scale) and s[0] == np.float32(1 / want.scale)
    assert s[2] == np.max(np.abs(x.astype(F32)))
    got = cp.asnumpy(out)
    assert np.array_equal(got, want.values.view(np.uint8))
    assert np.array_equal(cp.asnumpy(out_t), got.T)


def test_quantise_edge_cases(rng):
    """All zeros: scale 1, zero bytes. An inf or a NaN: NaN scales and NaN bytes (the E4M3 NaN
    is 0x7f / 0xff). One huge value: it sets the scale, the rest may flush towards zero, as
    the reference does."""
    z = np.zeros((64, 64), BF16)
    scales, out, _ = _quantise(z, "e4m3")
    assert list(cp.asnumpy(scales)) == [1.0, 1.0, 0.0] and not cp.asnumpy(out).any()
    for bad in (np.inf, np.nan):
        x = bf(rng.standard_normal((64, 128)))
        x[3, 5] = bad
        scales, out, _ = _quantise(x, "e4m3", transpose=False)
        assert np.isnan(cp.asnumpy(scales)[:2]).all()
        vals = cp.asnumpy(out).view(ml_dtypes.float8_e4m3fn).astype(F32)
        assert np.isnan(vals).all()
    x = bf(rng.standard_normal((32, 64)))
    x[0, 0] = 3e4
    _, out, _ = _quantise(x, "e4m3")
    assert np.array_equal(cp.asnumpy(out), ref.quantise(x, ref.E4M3).values.view(np.uint8))


def _guessed(x, fmt, state, slot, transpose=True):
    xd = dev(x)
    scales = cp.full(3, np.nan, F32)
    out = cp.full(x.shape, 0xAB, np.uint8)
    out_t = cp.full(x.shape[::-1], 0xAB, np.uint8) if transpose else None
    kc.fp8_quantise_guessed(CTX, xd, fmt, scales, out, out_t, state, slot)
    return scales, out, out_t


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_guessed_quantisation_gives_the_bytes_of_current_scaling(rng, dtype, fmt):
    """The same x quantised with its slot's guess unset (0), then right (the scale it learnt),
    then wrong both ways (one binade high and low), off the 64-wide tile and with the
    transpose or without: the scales and both layouts' bytes are quantise's every time; the
    header's amax word is back to 0 and the checks and misses are counted; the slot holds the
    true scale. A tensor with an inf gives quantise's NaN scales and NaN bytes and leaves the
    slot's finite guess."""
    h = kc.FP8_GUESS_HEADER
    state = cp.zeros(h + 3, F32)
    x = (rng.standard_normal((80, 208)) * np.exp(rng.uniform(-5, 2, (80, 208)))).astype(dtype)
    want_s, want, want_t = (cp.asnumpy(a) for a in _quantise(x, fmt))
    scale = want_s[1]
    misses = 0
    for guess, transpose in ((None, True), (scale, True), (2 * scale, False), (scale / 2, True),
                             (scale, False)):
        if guess is not None:
            state[h + 1] = guess
        misses += guess != scale
        scales, out, out_t = _guessed(x, fmt, state, 1, transpose)
        assert np.array_equal(cp.asnumpy(scales), want_s)
        assert np.array_equal(cp.asnumpy(out), want)
        if transpose:
            assert np.array_equal(cp.asnumpy(out_t), want_t)
        words = cp.asnumpy(state[:h].view(np.uint32))
        assert words[0] == 0 and words[3] == misses and cp.asnumpy(state)[h + 1] == scale
    assert cp.asnumpy(state[:h].view(np.uint32))[2] == 5
    bad = x.copy()
    bad[7, 9] = np.inf
    scales, out, _ = _guessed(bad, fmt, state, 1, transpose=False)
    assert np.isnan(cp.asnumpy(scales)[:2]).all() and cp.asnumpy(state)[h + 1] == scale
    f8 = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
    assert np.isnan(cp.asnumpy(out).view(f8).astype(F32)).all()
    assert cp.asnumpy(state)[h] == 0 and cp.asnumpy(state)[h + 2] == 0  # other slots untouched
    with pytest.raises(ValueError, match="guess slot 3 outside"):
        _guessed(x, fmt, state, 3)


def test_bad_shapes_and_formats_are_refused(rng):
    x = dev(bf(rng.standard_normal((40, 64))))
    with pytest.raises(ValueError, match="multiples of 16"):
        kc.fp8_cast(CTX, x, "e4m3", cp.ones(3, F32), cp.empty((40, 64), np.uint8))
    with pytest.raises(ValueError, match="choose one of"):
        kc.fp8_amax_scale(CTX, x, "e3m4", cp.ones(3, F32))
    a = cp.zeros((32, 32), np.uint8)
    with pytest.raises(ValueError, match="two E5M2"):
        kc.fp8_gemm(CTX, a, "e5m2", cp.ones(3, F32), a, "e5m2", cp.ones(3, F32),
                    cp.empty((32, 32), F32))


def _exact(qa, qb):
    """float64 product of the quantised values, scaled once: what the GEMM computes exactly."""
    return (qa.values.astype(np.float64) @ qb.values.astype(np.float64).T) / (qa.scale * qb.scale)


@pytest.mark.parametrize("m,n,k", [(512, 1024, 4096), (128, 4096, 1024), (4096, 64, 8192)])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("out", [BF16, F32])
def test_fp8_gemm_equals_the_exact_product_of_its_fp8_inputs(rng, m, n, k, fmts, out):
    """c = a @ b.T / (sa * sb) within c's rounding (bf16: 2^-8 relative; fp32: 2^-24) plus an
    fp32 sum of k products in any order (k * 2^-24 of the sum of magnitudes); then beta = 1."""
    a = bf(rng.standard_normal((m, k)))
    b = bf(rng.standard_normal((n, k)) * 0.02)
    fa, fb = (FORMATS[f] for f in fmts)
    qa, qb = ref.quantise(a, fa), ref.quantise(b, fb)
    sa, a8, _ = _quantise(a, fmts[0], transpose=False)
    sb, b8, _ = _quantise(b, fmts[1], transpose=False)
    c = cp.full((m, n), np.nan, out)
    kc.fp8_gemm(CTX, a8, fmts[0], sa, b8, fmts[1], sb, c)
    exact = _exact(qa, qb)
    mag = (np.abs(qa.values.astype(np.float64)) @ np.abs(qb.values.astype(np.float64)).T
           ) / (qa.scale * qb.scale)
    unit = 2.0 ** -8 if out == BF16 else 2.0 ** -24
    bound = unit * np.abs(exact) + k * 2.0 ** -24 * mag + 1e-30
    got = host(c).astype(np.float64)
    assert (np.abs(got - exact) <= bound).all(), np.max(np.abs(got - exact) / bound)
    c0 = got.astype(out)
    kc.fp8_gemm(CTX, a8, fmts[0], sa, b8, fmts[1], sb, c, accumulate=True)
    again = host(c).astype(np.float64)
    want = c0.astype(np.float64) + exact
    assert (np.abs(again - want) <= 2 * bound + unit * np.abs(want)).all()


def test_a_linear_layer_in_fp8_is_within_the_recipe_bound(rng):
    """y, dx, dw of one 8b-shaped projection (4096 -> 1024, 512 tokens) through the quantise
    kernels and fp8_gemm, against float64 of the unquantised bf16 inputs, within
    kernels.reference.fp8's bound (the per-element rounding of both operands plus fp32 sums)
    widened by the output's bf16 rounding."""
    t, i, o = 512, 4096, 1024
    x, w = bf(rng.standard_normal((t, i))), bf(rng.standard_normal((o, i)) * 0.02)
    dy = bf(rng.standard_normal((t, o)) * 1e-3)
    sx, x8, xt8 = _quantise(x, "e4m3")
    sw, w8, wt8 = _quantise(w, "e4m3")
    sd, d8, dt8 = _quantise(dy, "e5m2")
    y, dx = cp.empty((t, o), BF16), cp.empty((t, i), BF16)
    dw = cp.empty((o, i), F32)
    kc.fp8_gemm(CTX, x8, "e4m3", sx, w8, "e4m3", sw, y)
    kc.fp8_gemm(CTX, d8, "e5m2", sd, wt8, "e4m3", sw, dx)
    kc.fp8_gemm(CTX, dt8, "e5m2", sd, xt8, "e4m3", sx, dw)
    y_ref, qx, qw = ref.fp8_linear_fwd(x, w, np.float32)
    dx_ref, dw_ref = ref.fp8_linear_bwd(qx, qw, dy)
    x64, w64, d64 = (a.astype(np.float64) for a in (x, w, dy))
    for name, got, want_ref, a, b, fa, fb in (
            ("y", y, y_ref, x64, w64.T, ref.E4M3, ref.E4M3),
            ("dx", dx, dx_ref, d64, w64, ref.E5M2, ref.E4M3),
            ("dw", dw, dw_ref, d64.T, x64, ref.E5M2, ref.E4M3)):
        exact = a @ b
        ea, eb = ref.rounding_bound(a, fa), ref.rounding_bound(b, fb)
        k = a.shape[1]
        bound = (ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb
                 + k * 2.0 ** -24 * ((np.abs(a) + ea) @ (np.abs(b) + eb)))
        g = host(got).astype(np.float64)
        bound = bound + (2.0 ** -8 if got.dtype == BF16 else 0) * np.abs(exact) + 1e-30
        assert (np.abs(g - exact) <= bound).all(), (name, np.max(np.abs(g - exact) / bound))
        # and close to the reference of the same recipe (the same FP8 values, fp32 sums)
        rel = np.linalg.norm(g - want_ref) / np.linalg.norm(want_ref)
        assert rel < 5e-3, (name, rel)
