"""Output head and next-token cross-entropy, forward and backward together, in sub-chunks of
tokens (kernels/cuda/head_loss.cu + cuBLAS); matches dataflow.kernels.reference.head_loss. Per sub-chunk
of logits.shape[0] tokens: logits = x_s @ w.T into the fp32 scratch (gemmEx), a fused
softmax-cross-entropy kernel that rewrites that scratch in place as bf16 dlogits (row stride
2V) and records each row's loss, a deterministic loss reduction into loss_acc, then
dx_s = dlogits @ w and dw += dlogits.T @ x_s (gemmEx, beta = 1). Enqueued on the current CuPy
stream; no sync, no allocation."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32, I32
from dataflow.kernels.cuda._cublas import gemm

_SRC = "head_loss.cu"
_NAMES = ("xent_kernel<4>", "xent_kernel<1>", "xent_finish")
IGNORE = -100
"""A target equal to IGNORE contributes no loss and no gradient (transformers' ignore index;
the same value as dataflow.kernels.reference.IGNORE and head_loss.cu's)."""


def xent_kernel(ctx, elems_per_lane: int = 4):
    """The softmax-cross-entropy kernel alone (for benchmarks of its share of the head)."""
    return _build.kernel(ctx, _SRC, _NAMES, f"xent_kernel<{elems_per_lane}>")


def head_loss_fwd_bwd(ctx, x, w, targets, logits, grad_scale: float, dx, dw, loss_acc) -> None:
    """x (T, D) bf16, w (V, D) bf16, targets (T,) int32 device (IGNORE = -100) ->
    dx (T, D) bf16|f32 written, dw (V, D) bf16|f32 += (None: not formed), loss_acc (2,) f32 +=
    [loss_sum, n_valid].

    logits (sub, V) f32 is scratch (its contents are destroyed); sub = logits.shape[0] tokens are
    processed at a time. dx and dw are gradients of grad_scale * loss_sum (pass
    grad_scale = 1 / tokens_per_step for a mean loss). dlogits are rounded to bf16 before the
    two gradient GEMMs (fp32 accumulation inside them). n_valid is counted in fp32: exact up to
    2^24 tokens per accumulation. A target outside [0, V) other than IGNORE gives a NaN loss.
    """
    t, d = x.shape
    v = w.shape[0]
    _build.check("x", x, (t, d), (BF16,))
    _build.check("w", w, (v, d), (BF16,))
    _build.check("targets", targets, (t,), (I32,))
    _build.check("dx", dx, (t, d))
    if dw is not None:  # None: a frozen head, whose weight gradient is not formed
        _build.check("dw", dw, (v, d))
    _build.check("loss_acc", loss_acc, (2,), (F32,))
    if logits.ndim != 2 or logits.shape[1] != v or logits.shape[0] < 1:
        raise ValueError(f"logits scratch must be (sub, V={v}) fp32; got {tuple(logits.shape)}")
    _build.check("logits", logits, tuple(logits.shape), (F32,))
    if v < 4:
        raise ValueError(f"head_loss needs vocab_size >= 4, got {v}")
    sub = logits.shape[0]
    vec = 4 if v % 4 == 0 and logits.data.ptr % 16 == 0 else 1
    xent = _build.kernel(ctx, _SRC, _NAMES, f"xent_kernel<{vec}>")
    finish = _build.kernel(ctx, _SRC, _NAMES, "xent_finish")
    isz, dsz = x.dtype.itemsize, dx.dtype.itemsize
    lp = logits.data.ptr
    for t0 in range(0, t, sub):
        rows = min(sub, t - t0)
        xs = x.data.ptr + t0 * d * isz
        gemm(ctx, rows, v, d, xs, x.dtype, d, False, w.data.ptr, w.dtype, d, True,
             lp, F32, v, False)
        xent((rows,), (1024,), (logits, np.int32(v), targets[t0:t0 + rows], np.float32(grad_scale)))
        finish((1,), (1024,), (logits, np.int32(rows), np.int32(v), loss_acc))
        # dlogits: bf16 (rows, V) in place, row stride 2V elements (= one fp32 row).
        gemm(ctx, rows, d, v, lp, BF16, 2 * v, False, w.data.ptr, w.dtype, d, False,
             dx.data.ptr + t0 * d * dsz, dx.dtype, d, False)
        if dw is not None:
            gemm(ctx, v, d, rows, lp, BF16, 2 * v, True, xs, x.dtype, d, False,
                 dw.data.ptr, dw.dtype, d, True)
