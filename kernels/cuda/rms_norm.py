"""RMSNorm forward and backward on the GPU (kernels/cuda/rms_norm.cu); matches
dataflow.kernels.reference.rms_norm. Launches on the current CuPy stream, never synchronises, never
allocates except the backward's partial-sum scratch when the caller passes none (cached in the
CudaContext, once per (device, stream, shape))."""

from __future__ import annotations

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32

_SRC = "rms_norm.cu"
_NAMES = tuple(
    [f"rms_norm_fwd_kernel<{t}, {m}, {c}>" for t in ("bf16", "float") for m in (1, 2)
     for c in ("false", "true")]
    + [f"rms_norm_bwd_kernel<{t}, {m}, {r}>" for t in ("bf16", "float") for m in (1, 2)
       for r in ("false", "true")]
    + [f"rms_norm_dw_reduce<{t}>" for t in ("bf16", "float")]
)
MAX_PARTS = 256
"""Row groups (blocks) of the backward's first stage; its scratch is (min(T, MAX_PARTS), D) fp32.
A function of T alone, so the summation order (and the bits) do not depend on the device; 256
blocks of 256 threads (at most 128 registers each, __launch_bounds__(512)) fill a 132-SM H100
in one wave (2 blocks per SM)."""


def _shape_of_launch(D: int) -> tuple[int, int]:
    """(threads, packs per thread) for rows of D elements: at most 2 packs of 8 per thread."""
    if D % 8 or D <= 0 or D > 8192:
        raise ValueError(f"rms_norm needs model_dim a positive multiple of 8 up to 8192, got {D}")
    npacks = D // 8
    half = -(-npacks // 2)                       # ceil(npacks / 2)
    threads = min(512, max(32, -(-half // 32) * 32))
    return threads, (1 if npacks <= threads else 2)


def rms_norm_bwd_scratch_shape(n_tokens: int, model_dim: int) -> tuple[int, int]:
    """Shape of the fp32 scratch rms_norm_bwd needs for x (n_tokens, model_dim)."""
    return (min(n_tokens, MAX_PARTS), model_dim)


def rms_norm_fwd(ctx, x, w, eps: float, y, rstd, copy=None) -> None:
    """x (T, D) bf16|f32, w (D,) same dtype -> y (T, D) same dtype, rstd (T,) f32 (written).

    y = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps), fp32 math. y may alias x.
    `copy` (T, D): also receives x's bits, from the same read (it must not alias x or y).
    """
    n, d = x.shape
    _build.check("x", x, (n, d))
    _build.check("w", w, (d,), (x.dtype,))
    _build.check("y", y, (n, d), (x.dtype,))
    _build.check("rstd", rstd, (n,), (F32,))
    if copy is not None:
        _build.check("copy", copy, (n, d), (x.dtype,))
    if not _build.aligned16(x, w, y, y if copy is None else copy):
        raise ValueError("rms_norm_fwd needs x, w, y, copy on 16-byte boundaries")
    threads, maxp = _shape_of_launch(d)
    t = _build.ctype(x.dtype, "x")
    c = "false" if copy is None else "true"
    k = _build.kernel(ctx, _SRC, _NAMES, f"rms_norm_fwd_kernel<{t}, {maxp}, {c}>")
    if n:
        k((n,), (threads,), (x, w, y, rstd, np.int32(d), np.float32(eps),
                             y if copy is None else copy))


def rms_norm_bwd(ctx, x, w, rstd, dy, dx, dw_acc, scratch=None, residual=None) -> None:
    """x (T, D), w (D,), rstd (T,) f32, dy (T, D) -> dx (T, D) written; dw_acc (D,) bf16|f32 +=
    (None: not formed; the per-part partials still go through `scratch`).

    dx = rstd * (g - n * mean(g * n)) with g = dy * w, n = x * rstd; dw_acc += sum_t dy * n,
    reduced in two deterministic stages through `scratch` (f32, rms_norm_bwd_scratch_shape;
    a buffer cached in ctx per stream when None). fp32 math. dx may alias dy. `residual` (T, D): dx
    becomes dx rounded to its dtype plus residual, rounded again, the bits of add_(dx,
    residual) after the plain call, in the same pass.
    """
    n, d = x.shape
    _build.check("x", x, (n, d))
    _build.check("w", w, (d,), (x.dtype,))
    _build.check("rstd", rstd, (n,), (F32,))
    _build.check("dy", dy, (n, d), (x.dtype,))
    _build.check("dx", dx, (n, d), (x.dtype,))
    if dw_acc is not None:  # None: a frozen block's norm, whose weight gradient is not formed
        _build.check("dw_acc", dw_acc, (d,), (BF16, F32))
    if residual is not None:
        _build.check("residual", residual, (n, d), (x.dtype,))
    if not _build.aligned16(x, w, dy, dx, dy if residual is None else residual):
        raise ValueError("rms_norm_bwd needs x, w, dy, dx, residual on 16-byte boundaries")
    if n == 0:
        return
    parts = min(n, MAX_PARTS)
    if scratch is None:
        key = ("rms_norm_bwd", cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr,
               parts, d)
        scratch = ctx.scratch.get(key)
        if scratch is None:
            scratch = ctx.scratch[key] = cupy.empty((parts, d), dtype=F32)
    elif scratch.dtype != F32 or scratch.size < parts * d or not scratch.flags.c_contiguous:
        raise ValueError(f"rms_norm_bwd scratch must be contiguous fp32 with >= {parts * d} "
                         f"elements (rms_norm_bwd_scratch_shape); got {scratch.dtype} "
                         f"{scratch.shape}")
    threads, maxp = _shape_of_launch(d)
    t = _build.ctype(x.dtype, "x")
    res = "false" if residual is None else "true"
    k1 = _build.kernel(ctx, _SRC, _NAMES, f"rms_norm_bwd_kernel<{t}, {maxp}, {res}>")
    k1((parts,), (threads,), (x, w, rstd, dy, dx, scratch, np.int32(n), np.int32(d),
                              dy if residual is None else residual))
    if dw_acc is None:
        return
    tw = _build.ctype(dw_acc.dtype, "dw_acc")
    k2 = _build.kernel(ctx, _SRC, _NAMES, f"rms_norm_dw_reduce<{tw}>")
    k2((-(-d // 32),), (32, 8), (scratch, np.int32(parts), np.int32(d), dw_acc))
