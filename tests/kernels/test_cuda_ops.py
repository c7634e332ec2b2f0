"""Every CUDA op in dataflow.kernels.cuda against its NumPy reference on fresh random bf16 inputs.

Tolerance rule (STYLE §7, after flash-attention's tests): the truth is the reference run in
float64 on the same (bf16-valued) inputs; the "bf16 reference" is the reference run on the bf16
inputs in its fp32 arithmetic, with its outputs rounded to the fast path's output dtype and,
where the fast path rounds an intermediate to bf16 by design (attention's P and dS, the head's
dlogits), that intermediate rounded too. The fast path's relative error ‖out − truth‖/‖truth‖
may be at most twice the bf16 reference's, and never has to beat FP32_FLOOR (fp32 sums taken in
another order). Outputs are poisoned with NaN before each run, so an unwritten element fails.
Pure data movement (embedding gather, cast, fill, add_, the deterministic scatter-add) is
checked for exact equality. GPU only: skipped cleanly without CuPy or a device. Inputs come
from the shared `rng` fixture (tests/conftest.py: fresh seed per test, printed, replayable).
Set KERNEL_ERR_LOG to a path to collect every error figure in one file.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    _N_DEVICES = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver, or CuPy built for another CUDA
    _N_DEVICES = 0
if _N_DEVICES == 0:
    pytest.skip("no CUDA device visible to CuPy", allow_module_level=True)


import dataflow.kernels.cuda as kc  # noqa: E402
import dataflow.kernels.reference as ref  # noqa: E402
from tests.gpu import (BF16, F32, bf, check_close, cuda_context, dev,  # noqa: E402
                       f64, host, poisoned, rel, sync)

pytestmark = pytest.mark.gpu
CTX = cuda_context()
"""The CudaContext every kernel call of this module launches through."""


# ----------------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("n_tokens, model_dim", [(257, 1024), (1100, 512), (64, 5120)])
def test_rms_norm_cuda_matches_reference_on_random_bf16(rng, n_tokens, model_dim):
    """Forward y and rstd, backward dx and dw accumulated into bf16 and fp32 buffers."""
    x = bf(rng.standard_normal((n_tokens, model_dim)) * 2.0)
    w = bf(1.0 + 0.3 * rng.standard_normal(model_dim))
    dy = bf(rng.standard_normal((n_tokens, model_dim)))
    eps = 1e-5
    y_t, rstd_t = ref.rms_norm_fwd(f64(x), f64(w), eps)
    y_r, rstd_r = ref.rms_norm_fwd(x, w, eps)
    y, rstd = poisoned(x.shape, BF16), poisoned((n_tokens,), F32)
    kc.rms_norm_fwd(CTX, dev(x), dev(w), eps, y, rstd)
    check_close("rms_norm_fwd y", host(y), y_t, y_r)
    check_close("rms_norm_fwd rstd", host(rstd), rstd_t, rstd_r)

    rstd_in = rstd_r                                   # same statistics for every path
    dx_t, dw_t = ref.rms_norm_bwd(f64(x), f64(w), f64(rstd_in), f64(dy))
    dx_r, dw_r = ref.rms_norm_bwd(x, w, rstd_in, dy)
    for acc_dtype in (F32, BF16):
        dw0 = rng.standard_normal(model_dim).astype(acc_dtype)
        dx, dw = poisoned(x.shape, BF16), dev(dw0)
        kc.rms_norm_bwd(CTX, dev(x), dev(w), dev(rstd_in), dev(dy), dx, dw)
        check_close("rms_norm_bwd dx", host(dx), dx_t, dx_r)
        dw_ref = (f64(dw0).astype(F32) + dw_r).astype(acc_dtype)
        check_close(f"rms_norm_bwd dw_acc {acc_dtype}", host(dw), f64(dw0) + dw_t, dw_ref)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("model_dim", [256, 1024, 8192])  # one and two packs a thread
def test_rms_norm_fwd_copy_is_x_and_leaves_y_alone(rng, dtype, model_dim):
    """rms_norm_fwd(..., copy=c) writes x's bits to c and the same y and rstd as without it."""
    n = 130
    x = (rng.standard_normal((n, model_dim)) * 2.0).astype(F32).astype(dtype)
    w = (1.0 + 0.3 * rng.standard_normal(model_dim)).astype(F32).astype(dtype)
    outs = []
    for with_copy in (False, True):
        y, rstd, c = poisoned(x.shape, dtype), poisoned((n,), F32), poisoned(x.shape, dtype)
        kc.rms_norm_fwd(CTX, dev(x), dev(w), 1e-5, y, rstd, copy=c if with_copy else None)
        outs.append((host(y), host(rstd), host(c)))
    (y0, r0, _), (y1, r1, c1) = outs
    assert np.array_equal(c1.view(np.uint8), x.view(np.uint8))
    assert np.array_equal(y0.view(np.uint8), y1.view(np.uint8))
    assert np.array_equal(r0.view(np.uint8), r1.view(np.uint8))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_rms_norm_bwd_residual_is_the_bits_of_a_separate_add(rng, dtype):
    """rms_norm_bwd(..., residual=r) writes exactly what the plain call followed by add_(dx, r)
    wrote (the layer's two residual branches, fused); dw is unchanged by it."""
    n, d = 300, 1024
    x = rng.standard_normal((n, d)).astype(F32).astype(dtype)
    w = (1.0 + 0.3 * rng.standard_normal(d)).astype(F32).astype(dtype)
    dy = rng.standard_normal((n, d)).astype(F32).astype(dtype)
    r = rng.standard_normal((n, d)).astype(F32).astype(dtype)
    rstd = (1.0 + rng.random(n)).astype(F32)
    out = []
    for fused in (False, True):
        dx, dw = poisoned((n, d), dtype), cupy.zeros(d, F32)
        kc.rms_norm_bwd(CTX, dev(x), dev(w), dev(rstd), dev(dy), dx, dw,
                        residual=dev(r) if fused else None)
        if not fused:
            kc.add_(CTX, dx, dev(r))
        out.append((host(dx), host(dw)))
    (dx0, dw0), (dx1, dw1) = out
    assert np.array_equal(dx0.view(np.uint8), dx1.view(np.uint8))
    assert np.array_equal(dw0, dw1)
    dx_r, _ = ref.rms_norm_bwd(f64(x), f64(w), f64(rstd), f64(dy))
    assert rel(dx1, dx_r + f64(r)) < 1e-2


# ------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_linear_cuda_matches_reference_forward_and_both_gradients(rng, out_dtype):
    """y = x w^T (plain and residual-accumulating), dx = dy w, dw += dy^T x (bf16/f32 dw)."""
    t, i, o = 192, 320, 256
    x = bf(rng.standard_normal((t, i)))
    w = bf(rng.standard_normal((o, i)) / math.sqrt(i))
    dy = bf(rng.standard_normal((t, o)))
    y_t = f64(x) @ f64(w).T
    y_f32 = x.astype(F32) @ w.astype(F32).T          # the reference's own fp32 arithmetic
    y_r = y_f32.astype(out_dtype)
    y = poisoned((t, o), out_dtype)
    kc.linear_fwd(CTX, dev(x), dev(w), y)
    check_close(f"linear_fwd {out_dtype}", host(y), y_t, y_r)

    resid = rng.standard_normal((t, o)).astype(out_dtype)
    y = dev(resid)
    kc.linear_fwd(CTX, dev(x), dev(w), y, accumulate=True)
    check_close(f"linear_fwd residual {out_dtype}", host(y), f64(resid) + y_t,
                (f64(resid).astype(F32) + y_f32).astype(out_dtype))

    dx_t, dw_t = ref.linear_bwd(f64(x), f64(w), f64(dy))
    _, dw_r = ref.linear_bwd(x, w, dy)
    dx_r = (dy.astype(F32) @ w.astype(F32)).astype(out_dtype)
    dx = poisoned((t, i), out_dtype)
    kc.linear_bwd_x(CTX, dev(dy), dev(w), dx)
    check_close(f"linear_bwd_x {out_dtype}", host(dx), dx_t, dx_r)

    dw0 = rng.standard_normal((o, i)).astype(out_dtype)
    dw = dev(dw0)
    kc.linear_bwd_w(CTX, dev(dy), dev(x), dw, accumulate=True)
    check_close(f"linear_bwd_w += {out_dtype}", host(dw), f64(dw0) + dw_t,
                (f64(dw0).astype(F32) + dw_r).astype(out_dtype))
    dw = poisoned((o, i), out_dtype)
    kc.linear_bwd_w(CTX, dev(dy), dev(x), dw, accumulate=False)
    check_close(f"linear_bwd_w = {out_dtype}", host(dw), dw_t, dw_r.astype(out_dtype))


def test_linear_alpha_scales_the_fp32_product_before_the_one_rounding(rng):
    """linear_fwd / linear_bwd_x with alpha (LoRA's s = alpha / r folded into the GEMM), plain
    and accumulating, against alpha x the fp32 product rounded once; alpha 1 is the default's
    bits."""
    t, i, o, s = 160, 64, 16, 0.37
    x, a = bf(rng.standard_normal((t, i))), bf(rng.standard_normal((o, i)) / math.sqrt(i))
    dy = bf(rng.standard_normal((t, o)))
    y_t = s * (f64(x) @ f64(a).T)
    y = poisoned((t, o), BF16)
    kc.linear_fwd(CTX, dev(x), dev(a), y, False, s)
    check_close("linear_fwd alpha", host(y), y_t,
                ((x.astype(F32) @ a.astype(F32).T) * np.float32(s)).astype(BF16))
    resid = bf(rng.standard_normal((t, o)))
    y = dev(resid)
    kc.linear_fwd(CTX, dev(x), dev(a), y, True, s)
    check_close("linear_fwd alpha +=", host(y), f64(resid) + y_t,
                (resid.astype(F32) + (x.astype(F32) @ a.astype(F32).T)
                 * np.float32(s)).astype(BF16))
    dx = poisoned((t, i), BF16)
    kc.linear_bwd_x(CTX, dev(dy), dev(a), dx, False, s)
    check_close("linear_bwd_x alpha", host(dx), s * (f64(dy) @ f64(a)),
                ((dy.astype(F32) @ a.astype(F32)) * np.float32(s)).astype(BF16))
    y0, y1 = poisoned((t, o), BF16), poisoned((t, o), BF16)
    kc.linear_fwd(CTX, dev(x), dev(a), y0)
    kc.linear_fwd(CTX, dev(x), dev(a), y1, False, 1.0)
    assert np.array_equal(host(y0).view(np.uint16), host(y1).view(np.uint16))


# --------------------------------------------------------------------------------------- rope

@pytest.mark.parametrize("n_heads, head_dim", [(4, 64), (2, 128), (3, 16)])
def test_rope_cuda_matches_reference_at_positions_up_to_1m(rng, n_heads, head_dim):
    """Forward and backward rotation, out of place and in place, positions up to 10^6."""
    t = 200
    x = bf(rng.standard_normal((t, n_heads, head_dim)))
    pos = rng.integers(0, 1_000_001, size=t).astype(np.int32)
    pos[:3] = (0, 1, 1_000_000)
    theta = 500000.0
    for name, fn_c, fn_r in (("rope_fwd", kc.rope_fwd, ref.rope_fwd),
                             ("rope_bwd", kc.rope_bwd, ref.rope_bwd)):
        truth, r = fn_r(f64(x), pos, theta), fn_r(x, pos, theta)
        out = poisoned(x.shape, BF16)
        fn_c(CTX, dev(x), dev(pos), theta, out)
        check_close(f"{name} E={head_dim}", host(out), truth, r)
        inplace = dev(x)
        fn_c(CTX, inplace, dev(pos), theta, inplace)
        assert np.array_equal(host(inplace).view(np.uint16), host(out).view(np.uint16))


def test_rope_fp32_phase_error_at_1m_positions_is_fp32_rounding(rng):
    """With fp32 storage the only error left is fp32 rounding: the fp64 angles keep phase."""
    t, n, e = 256, 2, 128
    x = rng.standard_normal((t, n, e)).astype(F32)
    pos = np.sort(rng.integers(900_000, 1_000_001, size=t)).astype(np.int32)
    truth = ref.rope_fwd(f64(x), pos, 500000.0)
    out = poisoned(x.shape, F32)
    kc.rope_fwd(CTX, dev(x), dev(pos), 500000.0, out)
    got = host(out)
    check_close("rope_fwd fp32 at ~1M", got, truth, ref.rope_fwd(x, pos, 500000.0))
    line = f"rope_fwd fp32 max abs err at positions ~1M: {np.max(np.abs(f64(got) - truth)):.3e}"
    print(line)
    if os.environ.get("KERNEL_ERR_LOG"):
        with open(os.environ["KERNEL_ERR_LOG"], "a") as fh:
            fh.write(line + "\n")


# ------------------------------------------------------------------------------------- swiglu

def test_swiglu_cuda_matches_reference_including_ragged_tail(rng):
    """Forward and backward over T*F not a multiple of the vector width."""
    t, f = 37, 100
    gate = bf(rng.standard_normal((t, f)) * 3.0)
    up = bf(rng.standard_normal((t, f)))
    dh = bf(rng.standard_normal((t, f)))
    h = poisoned((t, f), BF16)
    kc.swiglu_fwd(CTX, dev(gate), dev(up), h)
    check_close("swiglu_fwd", host(h), ref.swiglu_fwd(f64(gate), f64(up)), ref.swiglu_fwd(gate, up))
    dg, du = poisoned((t, f), BF16), poisoned((t, f), BF16)
    kc.swiglu_bwd(CTX, dev(gate), dev(up), dev(dh), dg, du)
    dg_t, du_t = ref.swiglu_bwd(f64(gate), f64(up), f64(dh))
    dg_r, du_r = ref.swiglu_bwd(gate, up, dh)
    check_close("swiglu_bwd dgate", host(dg), dg_t, dg_r)
    check_close("swiglu_bwd dup", host(du), du_t, du_r)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("shape", [(37, 100), (64, 512)])  # ragged tail; 16-byte packs
def test_swiglu_bwd_out_is_the_bits_of_swiglu_fwd(rng, dtype, shape):
    """swiglu_bwd(..., out=h) writes the forward's h with swiglu_fwd's bits and leaves dgate,
    dup as the plain backward writes them."""
    gate, up, dh = (rng.standard_normal(shape).astype(F32).astype(dtype) for _ in range(3))
    h0, h1 = poisoned(shape, dtype), poisoned(shape, dtype)
    kc.swiglu_fwd(CTX, dev(gate), dev(up), h0)
    grads = []
    for out in (None, h1):
        dg, du = poisoned(shape, dtype), poisoned(shape, dtype)
        kc.swiglu_bwd(CTX, dev(gate), dev(up), dev(dh), dg, du, out=out)
        grads.append((host(dg), host(du)))
    assert np.array_equal(host(h0).view(np.uint8), host(h1).view(np.uint8))
    for a, b in zip(*grads):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ---------------------------------------------------------------------------------- embedding

def test_embedding_fwd_cuda_is_an_exact_gather_and_flags_bad_ids(rng):
    """Rows are copied bit-exactly; an out-of-range id yields a NaN row rather than a wild read."""
    v, d, t = 500, 256, 300
    table = bf(rng.standard_normal((v, d)))
    ids = rng.integers(0, v, size=t).astype(np.int32)
    out = poisoned((t, d), BF16)
    kc.embedding_fwd(CTX, dev(ids), dev(table), out)
    assert np.array_equal(host(out).view(np.uint16), ref.embedding_fwd(ids, table).view(np.uint16))
    ids[5] = v + 3
    out = poisoned((t, d), BF16)
    kc.embedding_fwd(CTX, dev(ids), dev(table), out)
    got = f64(host(out))
    assert np.all(np.isnan(got[5])) and np.all(np.isfinite(np.delete(got, 5, axis=0)))


@pytest.mark.parametrize("acc_dtype", [F32, BF16])
def test_embedding_bwd_cuda_sums_duplicates_in_token_order_exactly(rng, acc_dtype):
    """dtable += per-id sums of dx rows, bit-identical to an fp32 sum in token order added once
    into the accumulator (the ids come from a small range so most repeat)."""
    v, d, t = 64, 1024, 700
    ids = rng.integers(0, v // 2, size=t).astype(np.int32)
    dx = bf(rng.standard_normal((t, d)))
    dt0 = rng.standard_normal((v, d)).astype(acc_dtype)
    sums = ref.embedding_bwd(ids, dx, v)                   # fp32, np.add.at in token order
    want = (dt0.astype(F32) + sums).astype(acc_dtype)
    dt = dev(dt0)
    kc.embedding_bwd(CTX, dev(ids), dev(dx), dt)
    got = host(dt)
    view = np.uint16 if acc_dtype == BF16 else np.uint32
    assert np.array_equal(got.view(view), want.view(view))
    check_close(f"embedding_bwd {acc_dtype}", got, f64(dt0) + ref.embedding_bwd(ids, f64(dx), v),
                want)


# ---------------------------------------------------------------------------------- attention

def _attn_fwd_bf16_pipeline(q, k, v, q_offset):
    """Flash-style bf16 reference: fp32 scores and softmax, P rounded to bf16 before P @ V."""
    t, h, e = q.shape
    s, kh, _ = k.shape
    qf, kf, vf = (a.astype(F32) for a in (q, k, v))
    scale = F32.type(1.0 / math.sqrt(e))
    masked = np.arange(s)[None, :] > (q_offset + np.arange(t))[:, None]
    o = np.empty((t, h, e), F32)
    for hh in range(h):
        kv = hh // (h // kh)
        sc = (qf[:, hh] @ kf[:, kv].T) * scale
        sc[masked] = -np.inf
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        o[:, hh] = (bf(p).astype(F32) @ vf[:, kv]) / p.sum(axis=1, keepdims=True)
    return o.astype(BF16)


def _attn_bwd_bf16_pipeline(q, k, v, o, lse, do, q_offset):
    """Flash-style bf16 backward: P and dS rounded to bf16 before their GEMMs, outputs bf16."""
    t, h, e = q.shape
    s, kh, _ = k.shape
    qf, kf, vf, of, dof = (a.astype(F32) for a in (q, k, v, o, do))
    scale = F32.type(1.0 / math.sqrt(e))
    masked = np.arange(s)[None, :] > (q_offset + np.arange(t))[:, None]
    delta = np.sum(dof * of, axis=-1)
    dq = np.zeros((t, h, e), F32)
    dk = np.zeros((s, kh, e), F32)
    dv = np.zeros((s, kh, e), F32)
    for hh in range(h):
        kv = hh // (h // kh)
        p = np.exp((qf[:, hh] @ kf[:, kv].T) * scale - lse[hh][:, None])
        p[masked] = 0.0
        dv[:, kv] += bf(p).astype(F32).T @ dof[:, hh]
        ds = p * ((dof[:, hh] @ vf[:, kv].T) - delta[:, hh][:, None]) * scale
        dsb = bf(ds).astype(F32)
        dq[:, hh] = dsb @ kf[:, kv]
        dk[:, kv] += dsb.T @ qf[:, hh]
    return dq.astype(BF16), dk.astype(BF16), dv.astype(BF16)


ATTN_CASES = [  # (T, S, q_offset, H, K, E)
    (128, 128, 0, 4, 2, 64),          # one whole chunk, GQA group 2
    (96, 256, 160, 8, 2, 128),        # last chunk of a split sequence, GQA group 4
    (64, 320, 100, 4, 4, 64),         # a middle chunk: keys past q_offset + T unseen
    (200, 200, 0, 2, 1, 128),         # T not a multiple of the tile, one kv head
]


@pytest.mark.parametrize("impl", ["cudnn", "simple"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "T{}-S{}-off{}-H{}-K{}-E{}".format(*c))
def test_attention_cuda_matches_reference_causal_gqa_with_offset(rng, case, impl):
    """o, lse, dq, dk, dv for causal GQA chunks at offsets, through cuDNN SDPA and the simple
    kernels; dk, dv rows no query sees come back as zeros."""
    t, s, q_offset, h, kh, e = case
    q = bf(rng.standard_normal((t, h, e)))
    k = bf(rng.standard_normal((s, kh, e)))
    v = bf(rng.standard_normal((s, kh, e)))
    do = bf(rng.standard_normal((t, h, e)))
    o_t, lse_t = ref.attention_fwd(f64(q), f64(k), f64(v), q_offset)
    o_r, lse_r = ref.attention_fwd(q, k, v, q_offset)
    o_pipe = _attn_fwd_bf16_pipeline(q, k, v, q_offset) if impl == "cudnn" else o_r
    o, lse = poisoned((t, h, e), BF16), poisoned((h, t), F32)
    kc.attention_fwd(CTX, dev(q), dev(k), dev(v), q_offset, o, lse, impl=impl)
    check_close(f"attention_fwd o {impl} {case}", host(o), o_t, o_pipe)
    check_close(f"attention_fwd lse {impl} {case}", host(lse), lse_t, lse_r)

    # the backward gets the same o, lse on every path, so it is judged on its own
    dq_t, dk_t, dv_t = ref.attention_bwd(f64(q), f64(k), f64(v), f64(o_r), f64(lse_r), f64(do),
                                         q_offset)
    if impl == "cudnn":
        pipe = _attn_bwd_bf16_pipeline(q, k, v, o_r, lse_r, do, q_offset)
    else:
        dq_r, dk_r, dv_r = ref.attention_bwd(q, k, v, o_r, lse_r, do, q_offset)
        pipe = (dq_r, dk_r.astype(BF16), dv_r.astype(BF16))
    dq, dk, dv = (poisoned(a.shape, BF16) for a in (q, k, v))
    kc.attention_bwd(CTX, dev(q), dev(k), dev(v), dev(o_r), dev(lse_r), dev(do), q_offset, dq, dk,
                     dv, impl=impl)
    for name, got, truth, r in (("dq", dq, dq_t, pipe[0]), ("dk", dk, dk_t, pipe[1]),
                                ("dv", dv, dv_t, pipe[2])):
        check_close(f"attention_bwd {name} {impl} {case}", host(got), truth, r)
    unseen = q_offset + t
    assert np.all(f64(host(dk))[unseen:] == 0) and np.all(f64(host(dv))[unseen:] == 0)


def test_attention_chunks_accumulate_into_fp32_context_grads(rng):
    """Two chunks of one sequence, dk/dv added into fp32 buffers with add_, equal the gradient
    of the whole sequence taken at once (within the bf16 bound)."""
    t, h, kh, e = 128, 4, 2, 64
    s = 2 * t
    q = bf(rng.standard_normal((s, h, e)))
    k = bf(rng.standard_normal((s, kh, e)))
    v = bf(rng.standard_normal((s, kh, e)))
    do = bf(rng.standard_normal((s, h, e)))
    o_r, lse_r = ref.attention_fwd(q, k, v, 0)
    _, dk_t, dv_t = ref.attention_bwd(f64(q), f64(k), f64(v), f64(o_r), f64(lse_r), f64(do), 0)
    dk_acc, dv_acc = cupy.zeros((s, kh, e), F32), cupy.zeros((s, kh, e), F32)
    dk_pipe = np.zeros((s, kh, e), F32)
    dv_pipe = np.zeros((s, kh, e), F32)
    kd, vd = dev(k), dev(v)
    for c in range(2):
        sl = slice(c * t, (c + 1) * t)
        dq, dk, dv = poisoned((t, h, e), BF16), poisoned(k.shape, BF16), poisoned(k.shape, BF16)
        ws = cupy.empty(max(1, kc.attention_workspace_bytes(CTX, "bwd", t, h, kh, e, c * t)),
                        np.uint8)
        kc.attention_bwd(CTX, dev(q[sl]), kd, vd, dev(o_r[sl]),
                         dev(np.ascontiguousarray(lse_r[:, sl])), dev(do[sl]), c * t, dq, dk, dv,
                         workspace=ws)
        kc.add_(CTX, dk_acc, dk)
        kc.add_(CTX, dv_acc, dv)
        _, pk, pv = _attn_bwd_bf16_pipeline(q[sl], k, v, o_r[sl], lse_r[:, sl], do[sl], c * t)
        dk_pipe += pk.astype(F32)
        dv_pipe += pv.astype(F32)
    check_close("attention 2 chunks dk (fp32 acc)", host(dk_acc), dk_t, dk_pipe)
    check_close("attention 2 chunks dv (fp32 acc)", host(dv_acc), dv_t, dv_pipe)


@pytest.mark.parametrize("deterministic", [True, False])
def test_attention_bwd_own_equals_the_fp32_accumulate_path(rng, deterministic):
    """The op table's attention_bwd_own (a packed chunk's documents, each against its own keys,
    bf16 dK/dV written directly) gives the values of attention_bwd accumulated from zero in fp32
    and cast, as the layer took them before, and is within the bf16 bound of the truth."""
    from dataflow.ops_cuda import CudaOps

    t, h, kh, e = 192, 4, 2, 64
    segs = ((0, 80), (80, 192))  # two documents packed in one chunk
    q = bf(rng.standard_normal((t, h, e)))
    k = bf(rng.standard_normal((t, kh, e)))
    v = bf(rng.standard_normal((t, kh, e)))
    do = bf(rng.standard_normal((t, h, e)))
    o = np.empty((t, h, e), BF16)
    lse = np.empty((h, t), F32)
    for a, b in segs:
        o[a:b], lse[:, a:b] = ref.attention_fwd(q[a:b], k[a:b], v[a:b], 0)
    ops = CudaOps()
    if deterministic:  # a lent workspace the deterministic algorithm fits
        need = max(kc.attention_workspace_bytes(CTX, "bwd", b - a, h, kh, e, 0, deterministic=True)
                   for a, b in segs)
        ops.lend_scratch({"attn_workspace": cupy.empty(max(need, 1), np.uint8)})
    qd, kd, vd, od, dod = (dev(x) for x in (q, k, v, o, do))

    def lse_d(a, b):
        return dev(np.ascontiguousarray(lse[:, a:b]))

    dq1, dk1, dv1 = (poisoned(x.shape, BF16) for x in (q, k, v))
    for a, b in segs:
        ops.attention_bwd_own(qd[a:b], kd[a:b], vd[a:b], od[a:b], lse_d(a, b), dod[a:b], dq1[a:b],
                              dk1[a:b], dv1[a:b])
    dq2 = poisoned(q.shape, BF16)
    dk32, dv32 = cupy.zeros((t, kh, e), F32), cupy.zeros((t, kh, e), F32)
    for a, b in segs:
        ops.attention_bwd(qd[a:b], kd[a:b], vd[a:b], od[a:b], lse_d(a, b), dod[a:b], 0, dq2[a:b],
                          dk32[a:b], dv32[a:b])
    dk2, dv2 = poisoned(k.shape, BF16), poisoned(v.shape, BF16)
    kc.cast(CTX, dk32, dk2)
    kc.cast(CTX, dv32, dv2)
    assert np.array_equal(f64(host(dk1)), f64(host(dk2)))
    assert np.array_equal(f64(host(dv1)), f64(host(dv2)))
    if deterministic:  # the atomic algorithm's dQ may differ in its last bits run to run
        assert np.array_equal(f64(host(dq1)), f64(host(dq2)))
    for (a, b), name in ((segs[0], "doc 0"), (segs[1], "doc 1")):
        truth = ref.attention_bwd(f64(q[a:b]), f64(k[a:b]), f64(v[a:b]), f64(o[a:b]),
                                  f64(lse[:, a:b]), f64(do[a:b]), 0)
        pipe = _attn_bwd_bf16_pipeline(q[a:b], k[a:b], v[a:b], o[a:b], lse[:, a:b], do[a:b], 0)
        for i, got in enumerate((dq1, dk1, dv1)):
            check_close(f"attention_bwd_own {'dq dk dv'.split()[i]} {name}", host(got[a:b]),
                        truth[i], pipe[i])


# ---------------------------------------------------------------------------------- head loss

def _head_bf16_pipeline(x, w, targets, sub, grad_scale, dw0):
    """Reference with fp32 logits and softmax, dlogits rounded to bf16 before the GEMMs, and dw
    rounded to its dtype after each sub-chunk (the fast path's beta = 1 accumulation)."""
    xf, wf = x.astype(F32), w.astype(F32)
    dx = np.empty(x.shape, F32)
    dw = dw0.copy()
    for t0 in range(0, x.shape[0], sub):
        xs, tg = xf[t0:t0 + sub], targets[t0:t0 + sub]
        lg = xs @ wf.T
        p = np.exp(lg - lg.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        rows = np.nonzero(tg != ref.IGNORE)[0]
        p[rows, tg[rows]] -= 1.0
        p[tg == ref.IGNORE] = 0.0
        dl = bf(p * F32.type(grad_scale)).astype(F32)
        dx[t0:t0 + sub] = dl @ wf
        dw = (dw.astype(F32) + dl.T @ xs).astype(dw0.dtype)
    return dx.astype(BF16), dw


@pytest.mark.parametrize("vocab", [1000, 998])
@pytest.mark.parametrize("dw_dtype", [F32, BF16])
def test_head_loss_cuda_matches_reference_with_ignored_targets(rng, vocab, dw_dtype):
    """Loss sum and count, dx and accumulated dw over 3 sub-chunks (the last one partial), with
    a fifth of the targets IGNORE; vocab 998 takes the scalar (non-float4) path."""
    t, d, sub = 300, 256, 128
    x = bf(rng.standard_normal((t, d)))
    w = bf(rng.standard_normal((vocab, d)) / math.sqrt(d) * 2.0)
    targets = rng.integers(0, vocab, size=t).astype(np.int32)
    targets[rng.random(t) < 0.2] = ref.IGNORE
    grad_scale = 1.0 / t
    loss_t, n_t, dx_t, dw_t = ref.head_loss_fwd_bwd(f64(x), f64(w), targets, sub_tokens=sub,
                                                    grad_scale=grad_scale)
    loss_r, _, _, _ = ref.head_loss_fwd_bwd(x, w, targets, sub_tokens=sub, grad_scale=grad_scale)
    dw0 = (rng.standard_normal((vocab, d)) * 1e-3).astype(dw_dtype)
    dx_r, dw_r = _head_bf16_pipeline(x, w, targets, sub, grad_scale, dw0)
    logits = poisoned((sub, vocab), F32)
    dx, dw = poisoned((t, d), BF16), dev(dw0)
    loss_acc = dev(np.array([0.25, 3.0], F32))
    kc.head_loss_fwd_bwd(CTX, dev(x), dev(w), dev(targets), logits, grad_scale, dx, dw, loss_acc)
    got = host(loss_acc)
    assert got[1] - 3.0 == n_t
    check_close("head_loss loss_sum", np.array([got[0] - 0.25]), np.array([loss_t]),
                np.array([loss_r]))
    check_close(f"head_loss dx V={vocab}", host(dx), dx_t, dx_r)
    check_close(f"head_loss dw {dw_dtype} V={vocab}", host(dw), f64(dw0) + dw_t, dw_r)


# -------------------------------------------------------------------------------------- adamw

@pytest.mark.parametrize("grad_dtype", [BF16, F32])
def test_adamw_cuda_matches_reference_on_a_ragged_block(rng, grad_dtype):
    """One in-place step over a block whose size is not a multiple of 8, bf16 param/m/v."""
    n = 10_003
    p0 = bf(rng.standard_normal(n) * 0.05)
    g = rng.standard_normal(n).astype(grad_dtype)
    m0 = bf(rng.standard_normal(n) * 0.01)
    v0 = bf(np.abs(rng.standard_normal(n)) * 1e-3 + 1e-6)
    hp = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    pt, mt, vt = f64(p0), f64(m0), f64(v0)
    ref.adamw_step(pt, f64(g), mt, vt, **hp)
    pr, mr, vr = p0.copy(), m0.copy(), v0.copy()
    ref.adamw_step(pr, g, mr, vr, **hp)
    pd, md, vd = dev(p0), dev(m0), dev(v0)
    kc.adamw_step(CTX, pd, dev(g), md, vd, **hp)
    check_close(f"adamw param grad={grad_dtype}", host(pd), pt, pr)
    check_close(f"adamw m grad={grad_dtype}", host(md), mt, mr)
    check_close(f"adamw v grad={grad_dtype}", host(vd), vt, vr)


def test_adamw_reads_clip_factor_from_device_scalar(rng):
    """grad_scale_dev multiplies the gradient on the device: same bits as the host scale."""
    n = 4096
    p0, g = bf(rng.standard_normal(n)), bf(rng.standard_normal(n))
    m0, v0 = bf(rng.standard_normal(n) * 0.01), bf(np.abs(rng.standard_normal(n)) * 1e-3)
    runs = []
    for host_scale, dev_scale in ((0.25, None), (1.0, dev(np.array([0.25], F32)))):
        pd, md, vd = dev(p0), dev(m0), dev(v0)
        kc.adamw_step(CTX, pd, dev(g), md, vd, step=1, lr=1e-2, grad_scale=host_scale,
                      grad_scale_dev=dev_scale)
        runs.append(np.concatenate([host(a).view(np.uint16) for a in (pd, md, vd)]))
    assert np.array_equal(runs[0], runs[1])


# -------------------------------------------------------------------------------------- utils

def test_add_cast_fill_are_exact_in_every_dtype_combination(rng):
    """add_ rounds fp32(dst) + fp32(src) once; cast and fill round to nearest even."""
    n = 1037
    for dd in (BF16, F32):
        for sd in (BF16, F32):
            a = (rng.standard_normal(n) * 10).astype(dd)
            b = (rng.standard_normal(n) * 10).astype(sd)
            d = dev(a)
            kc.add_(CTX, d, dev(b))
            want = (a.astype(F32) + b.astype(F32)).astype(dd)
            view = np.uint16 if dd == BF16 else np.uint32
            assert np.array_equal(host(d).view(view), want.view(view)), (dd, sd)
            out = poisoned(n, dd)
            kc.cast(CTX, dev(b), out)
            assert np.array_equal(host(out).view(view), b.astype(F32).astype(dd).view(view))
    x = poisoned((3, 333), BF16)
    kc.fill_(CTX, x, 1.0 / 3.0)
    assert np.array_equal(host(x).view(np.uint16),
                          np.full((3, 333), 1.0 / 3.0, F32).astype(BF16).view(np.uint16))


def test_sumsq_and_clip_scale_match_float64(rng):
    """sumsq over ragged bf16/f32 inputs (accumulating) and the clip factor on the device."""
    for dt in (BF16, F32):
        x = (rng.standard_normal(123_457) * 3).astype(dt)
        out = dev(np.array([7.5], F32))
        kc.sumsq(CTX, dev(x), out, accumulate=True)
        truth = 7.5 + np.sum(f64(x) ** 2)
        check_close(f"sumsq {dt}", host(out), np.array([truth]), np.array([truth], F32))
        kc.sumsq(CTX, dev(x), out, accumulate=False)
        check_close(f"sumsq = {dt}", host(out), np.array([truth - 7.5]),
                    np.array([truth - 7.5], F32))
    ss = dev(np.array([400.0], F32))
    sc = poisoned(1, F32)
    kc.clip_scale(CTX, ss, 1.0, sc, scale=0.5)
    assert abs(float(host(sc)[0]) - 0.5 / (20.0 + 1e-6)) < 1e-7


# -------------------------------------------------------------------------------- determinism

def test_reductions_are_bit_identical_run_to_run(rng):
    """embedding_bwd, rms_norm_bwd, sumsq, head_loss and (cuDNN, deterministic by default)
    attention_bwd give the same bits twice: reruns and placement-only plan changes must not
    move the result (DESIGN §5)."""
    t, d, v = 512, 512, 256
    ids = dev(rng.integers(0, 40, size=t).astype(np.int32))
    x = dev(bf(rng.standard_normal((t, d))))
    dy = dev(bf(rng.standard_normal((t, d))))
    w = dev(bf(1 + 0.1 * rng.standard_normal(d)))
    wh = dev(bf(rng.standard_normal((v, d)) * 0.05))
    tg = dev(rng.integers(0, v, size=t).astype(np.int32))
    rstd = poisoned(t, F32)
    kc.rms_norm_fwd(CTX, x, w, 1e-5, poisoned((t, d), BF16), rstd)
    h, kh, e = 8, 2, 64
    q, do = (dev(bf(rng.standard_normal((t, h, e)))) for _ in range(2))
    k, val = (dev(bf(rng.standard_normal((t, kh, e)))) for _ in range(2))
    o, lse = poisoned((t, h, e), BF16), poisoned((h, t), F32)
    kc.attention_fwd(CTX, q, k, val, 0, o, lse)

    def once():
        dtab = cupy.zeros((v, d), F32)
        kc.embedding_bwd(CTX, ids, dy, dtab)
        dw = cupy.zeros(d, F32)
        kc.rms_norm_bwd(CTX, x, w, rstd, dy, poisoned((t, d), BF16), dw)
        ss = cupy.zeros(1, F32)
        kc.sumsq(CTX, dy, ss)
        la, dwh = cupy.zeros(2, F32), cupy.zeros((v, d), F32)
        kc.head_loss_fwd_bwd(CTX, x, wh, tg, poisoned((100, v), F32), 1.0, poisoned((t, d), BF16),
                             dwh, la)
        dq = poisoned((t, h, e), BF16)
        dk, dv = poisoned((t, kh, e), BF16), poisoned((t, kh, e), BF16)
        kc.attention_bwd(CTX, q, k, val, o, lse, do, 0, dq, dk, dv)
        sync()
        return [cupy.asnumpy(a.view(cupy.uint8)).tobytes()
                for a in (dtab, dw, ss, la, dwh, dq, dk, dv)]

    assert once() == once()
