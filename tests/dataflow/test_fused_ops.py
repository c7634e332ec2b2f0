"""The NumPy op table's fused forms give the bits of the op sequences they replaced in the layer
(the CPU twin of tests/kernels/test_cuda_ops.py's checks): rms_norm_fwd's copy, rms_norm_bwd's
residual, swiglu_bwd's out and attention_bwd_own. Fresh random bf16 inputs (never zeros)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import dataflow.kernels.reference as ref
from dataflow import ops_numpy as ops

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _bf(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32).astype(BF16)


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_rms_norm_fwd_copy_is_x_and_leaves_y_alone(rng):
    t, d = 48, 64
    x, w = _bf(rng, (t, d), 2.0), _bf(rng, (d,), 0.3) + BF16.type(1.0)
    y0, r0 = np.empty((t, d), BF16), np.empty(t, F32)
    ops.rms_norm_fwd(x, w, 1e-5, y0, r0)
    y1, r1, c = np.empty((t, d), BF16), np.empty(t, F32), np.empty((t, d), BF16)
    ops.rms_norm_fwd(x, w, 1e-5, y1, r1, c)
    assert _same_bits(c, x) and _same_bits(y0, y1) and _same_bits(r0, r1)


def test_rms_norm_fwd_copy_is_taken_before_an_aliased_y_is_written(rng):
    t, d = 16, 32
    x, w = _bf(rng, (t, d)), _bf(rng, (d,), 0.3) + BF16.type(1.0)
    x0 = x.copy()
    c, rstd = np.empty((t, d), BF16), np.empty(t, F32)
    ops.rms_norm_fwd(x, w, 1e-5, x, rstd, c)  # y aliases x
    assert _same_bits(c, x0)


def test_rms_norm_bwd_residual_is_the_bits_of_a_separate_add(rng):
    t, d = 40, 64
    x, w, dy, r = (_bf(rng, (t, d)), _bf(rng, (d,)), _bf(rng, (t, d)), _bf(rng, (t, d)))
    rstd = (1.0 + rng.random(t)).astype(F32)
    dx0, dw0 = np.empty((t, d), BF16), np.zeros(d, F32)
    ops.rms_norm_bwd(x, w, rstd, dy, dx0, dw0)
    ops.add_(dx0, r)
    dx1, dw1 = np.empty((t, d), BF16), np.zeros(d, F32)
    ops.rms_norm_bwd(x, w, rstd, dy, dx1, dw1, r)
    assert _same_bits(dx0, dx1) and _same_bits(dw0, dw1)


def test_swiglu_bwd_out_is_the_bits_of_swiglu_fwd(rng):
    shape = (24, 40)
    gate, up, dh = _bf(rng, shape, 3.0), _bf(rng, shape), _bf(rng, shape)
    h0 = np.empty(shape, BF16)
    ops.swiglu_fwd(gate, up, h0)
    dg0, du0 = np.empty(shape, BF16), np.empty(shape, BF16)
    ops.swiglu_bwd(gate, up, dh, dg0, du0)
    dg1, du1, h1 = np.empty(shape, BF16), np.empty(shape, BF16), np.empty(shape, BF16)
    ops.swiglu_bwd(gate, up, dh, dg1, du1, h1)
    assert _same_bits(h0, h1) and _same_bits(dg0, dg1) and _same_bits(du0, du1)


def test_attention_bwd_own_is_the_fp32_accumulate_path(rng):
    """Two packed documents, each against its own keys: the bf16 dK/dV written directly equal
    the old path's (zero fp32 accumulators, attention_bwd adds into them, cast to bf16)."""
    t, h, kh, e = 40, 4, 2, 16
    segs = ((0, 17), (17, 40))
    q, k, v, do = (_bf(rng, (t, h, e)), _bf(rng, (t, kh, e)), _bf(rng, (t, kh, e)),
                   _bf(rng, (t, h, e)))
    o, lse = np.empty((t, h, e), BF16), np.empty((h, t), F32)
    for a, b in segs:
        o_, lse_ = ref.attention_fwd(q[a:b], k[a:b], v[a:b], 0)
        o[a:b], lse[:, a:b] = o_, lse_
    dq0 = np.empty((t, h, e), BF16)
    dk32, dv32 = np.zeros((t, kh, e), F32), np.zeros((t, kh, e), F32)
    dq1, dk1, dv1 = (np.empty(x.shape, BF16) for x in (q, k, v))
    for a, b in segs:
        lse_s = np.ascontiguousarray(lse[:, a:b])
        ops.attention_bwd(q[a:b], k[a:b], v[a:b], o[a:b], lse_s, do[a:b], 0, dq0[a:b],
                          dk32[a:b], dv32[a:b])
        ops.attention_bwd_own(q[a:b], k[a:b], v[a:b], o[a:b], lse_s, do[a:b], dq1[a:b],
                              dk1[a:b], dv1[a:b])
    dk0, dv0 = np.empty(k.shape, BF16), np.empty(v.shape, BF16)
    ops.cast(dk32, dk0)
    ops.cast(dv32, dv0)
    assert _same_bits(dq0, dq1)
    # values, not bits: the old path's 0.0 + x turned an exact -0.0 into +0.0
    assert np.array_equal(dk0.astype(F32), dk1.astype(F32))
    assert np.array_equal(dv0.astype(F32), dv1.astype(F32))
