"""Linear layer y = x @ w.T (w stored [out_features, in_features]) and its two gradients through
cuBLAS gemmEx; matches dataflow.kernels.reference.linear. bf16 operands, fp32 accumulation, outputs bf16
or fp32; `accumulate` adds into the output (beta = 1) to fuse a residual add or to accumulate
weight gradients over chunks. Enqueued on the current CuPy stream; no sync, no allocation."""

from __future__ import annotations

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._cublas import gemm


def linear_fwd(ctx, x, w, y, accumulate: bool = False, alpha: float = 1.0) -> None:
    """x (T, I), w (O, I) bf16 -> y (T, O) bf16|f32: y = alpha * (x @ w.T) (+ y when
    accumulate); alpha scales the fp32 product before the one rounding."""
    t, i = x.shape
    o = w.shape[0]
    _build.check("x", x, (t, i))
    _build.check("w", w, (o, i), (x.dtype,))
    _build.check("y", y, (t, o))
    gemm(ctx, t, o, i, x.data.ptr, x.dtype, i, False, w.data.ptr, w.dtype, i, True,
         y.data.ptr, y.dtype, o, accumulate, alpha)


def linear_bwd_x(ctx, dy, w, dx, accumulate: bool = False, alpha: float = 1.0) -> None:
    """dy (T, O), w (O, I) bf16 -> dx (T, I) bf16|f32: dx = alpha * (dy @ w) (+ dx when
    accumulate); alpha scales the fp32 product before the one rounding."""
    t, o = dy.shape
    i = w.shape[1]
    _build.check("dy", dy, (t, o))
    _build.check("w", w, (o, i), (dy.dtype,))
    _build.check("dx", dx, (t, i))
    gemm(ctx, t, i, o, dy.data.ptr, dy.dtype, o, False, w.data.ptr, w.dtype, i, False,
         dx.data.ptr, dx.dtype, i, accumulate, alpha)


def linear_bwd_w(ctx, dy, x, dw, accumulate: bool = True) -> None:
    """dy (T, O), x (T, I) bf16 -> dw (O, I) bf16|f32: dw = dy.T @ x (+ dw when accumulate).

    fp32 accumulation inside the GEMM; with a bf16 dw each call rounds the running sum once.
    """
    t, o = dy.shape
    i = x.shape[1]
    _build.check("dy", dy, (t, o))
    _build.check("x", x, (t, i), (dy.dtype,))
    _build.check("dw", dw, (o, i))
    gemm(ctx, o, i, t, dy.data.ptr, dy.dtype, o, True, x.data.ptr, x.dtype, i, False,
         dw.data.ptr, dw.dtype, i, accumulate)
