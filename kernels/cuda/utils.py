"""Elementwise and reduction utilities on the GPU (kernels/cuda/utils.cu): add_ (gradient
accumulation in any bf16/f32 combination), cast, fill_, sumsq (deterministic global grad-norm
piece), sumsq_blocks (each sub-block's float64 sum of squares, for the exact norm of
dataflow.norm_parts), clip_scale (clip-by-global-norm factor on the device), and bias_fill /
bias_bwd (the forward start and the gradient of a projection's bias, Qwen2's q/k/v). Enqueued on
the current CuPy stream; never synchronises; sumsq allocates only its tiny per-stream scratch on
first use when the caller passes none (kept in the CudaContext)."""

from __future__ import annotations

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import F32

F64 = np.dtype(np.float64)

_SRC = "utils.cu"
_TYPES = ("bf16", "float")
_NAMES = tuple(
    [f"add_kernel<{d}, {s}, {v}>" for d in _TYPES for s in _TYPES for v in (1, 8)]
    + [f"cast_kernel<{s}, {d}, {v}>" for d in _TYPES for s in _TYPES for v in (1, 8)]
    + [f"fill_kernel<{d}, {v}>" for d in _TYPES for v in (1, 8)]
    + [f"scale_kernel<{d}, {v}>" for d in _TYPES for v in (1, 8)]
    + [f"sumsq_partial<{s}, {v}>" for s in _TYPES for v in (1, 8)]
    + [f"sumsq_blocks<{s}>" for s in _TYPES]
    + ["sumsq_finish", "clip_scale_kernel"]
    + [f"bias_fill_kernel<{t}>" for t in _TYPES]
    + [f"bias_bwd_kernel<{s}, {w}>" for s in _TYPES for w in _TYPES]
)
_THREADS = 256
SUMSQ_PARTS = 1024
"""Most first-stage blocks of sumsq; its scratch holds this many fp32 values."""


def _vec(*arrays) -> int:
    return 8 if _build.aligned16(*arrays) else 1


def _same_size(name_a: str, a, name_b: str, b) -> None:
    _build.check(name_a, a)
    _build.check(name_b, b)
    if a.size != b.size:
        raise ValueError(f"{name_a} and {name_b} differ in size: {a.shape} and {b.shape}")


def add_(ctx, dst, src) -> None:
    """dst += src elementwise (fp32 add, one rounding to dst's dtype); bf16|f32 in any mix.

    Shapes may differ as long as sizes agree (flat views of the same layout).
    """
    _same_size("dst", dst, "src", src)
    v = _vec(dst, src)
    name = f"add_kernel<{_build.ctype(dst.dtype, 'dst')}, {_build.ctype(src.dtype, 'src')}, {v}>"
    n = dst.size
    if n:
        _build.kernel(ctx, _SRC, _NAMES, name)((_build.flat_grid(ctx, -(-n // v), _THREADS),),
                                               (_THREADS,), (dst, src, np.int64(n)))


def cast(ctx, src, dst) -> None:
    """dst = src converted to dst's dtype (round to nearest even for fp32 -> bf16)."""
    _same_size("src", src, "dst", dst)
    v = _vec(dst, src)
    name = f"cast_kernel<{_build.ctype(src.dtype, 'src')}, {_build.ctype(dst.dtype, 'dst')}, {v}>"
    n = dst.size
    if n:
        _build.kernel(ctx, _SRC, _NAMES, name)((_build.flat_grid(ctx, -(-n // v), _THREADS),),
                                               (_THREADS,), (src, dst, np.int64(n)))


def scale_(ctx, x, s: float) -> None:
    """x *= s in place for bf16|f32 x (the LoRA adapters' (T, r) intermediates): fp32 product,
    one rounding to x's dtype (dataflow.kernels.reference.lora.scale); no temporary."""
    _build.check("x", x)
    v = _vec(x)
    n = x.size
    if n:
        _build.kernel(ctx, _SRC, _NAMES, f"scale_kernel<{_build.ctype(x.dtype, 'x')}, {v}>")(
            (_build.flat_grid(ctx, -(-n // v), _THREADS),), (_THREADS,),
            (x, np.float32(s), np.int64(n)))


def fill_(ctx, x, value: float) -> None:
    """x[...] = value (rounded to x's dtype)."""
    _build.check("x", x)
    v = _vec(x)
    n = x.size
    if n:
        _build.kernel(ctx, _SRC, _NAMES, f"fill_kernel<{_build.ctype(x.dtype, 'x')}, {v}>")(
            (_build.flat_grid(ctx, -(-n // v), _THREADS),), (_THREADS,),
            (x, np.float32(value), np.int64(n)))


def sumsq(ctx, x, out, accumulate: bool = False, scratch=None) -> None:
    """out (1,) f32 device = (out +) sum(x^2) over bf16|f32 x, fp32 accumulation.

    Two deterministic stages through `scratch` (>= SUMSQ_PARTS fp32 values; a buffer cached
    in ctx per stream when None): the same x gives the same bits every time.
    """
    _build.check("x", x)
    _build.check("out", out, None, (F32,))
    if out.size != 1:
        raise ValueError(f"sumsq writes one fp32 value; out has shape {out.shape}")
    if scratch is None:
        key = ("sumsq", cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
        scratch = ctx.scratch.get(key)
        if scratch is None:
            scratch = ctx.scratch[key] = cupy.empty(SUMSQ_PARTS, dtype=F32)
    elif scratch.dtype != F32 or scratch.size < SUMSQ_PARTS:
        raise ValueError(f"sumsq scratch must be fp32 with >= {SUMSQ_PARTS} values")
    v = _vec(x)
    n = x.size
    # P depends on n only (not on the device), so the summation order is fixed for a given x.
    parts = max(1, min(SUMSQ_PARTS, -(-n // (v * _THREADS * 4))))
    _build.kernel(ctx, _SRC, _NAMES, f"sumsq_partial<{_build.ctype(x.dtype, 'x')}, {v}>")(
        (parts,), (_THREADS,), (x, np.int64(n), scratch))
    _build.kernel(ctx, _SRC, _NAMES, "sumsq_finish")(
        (1,), (1024,), (scratch, np.int32(parts), out, np.int32(bool(accumulate))))


def sumsq_blocks(ctx, x, out, sub: int = 1024) -> None:
    """out (ceil(n / sub),) f64 device = each sub-block's sum of x^2 over the flat bf16|f32 x
    (sub-block b: elements [b sub, min(n, (b + 1) sub))), summed in float64 in a fixed order
    that depends on the sub-block's elements only (utils.cu); no scratch, no atomics."""
    _build.check("x", x)
    _build.check("out", out, None, (F64,))
    n = x.size
    blocks = -(-n // sub)
    if out.size != blocks:
        raise ValueError(f"sumsq_blocks writes {blocks} values (n {n}, sub-blocks of {sub}); "
                         f"out has shape {out.shape}")
    if blocks:
        _build.kernel(ctx, _SRC, _NAMES, f"sumsq_blocks<{_build.ctype(x.dtype, 'x')}>")(
            (blocks,), (_THREADS,), (x, np.int64(n), np.int32(sub), out))


def clip_scale(ctx, sumsq_value, max_norm: float, out, scale: float = 1.0) -> None:
    """out (1,) f32 = scale * min(1, max_norm / (sqrt(sumsq_value) + 1e-6)), on the device.

    Feed `out` to adamw_step(grad_scale_dev=out) to clip by global norm without a host sync.
    """
    _build.check("sumsq_value", sumsq_value, None, (F32,))
    _build.check("out", out, None, (F32,))
    _build.kernel(ctx, _SRC, _NAMES, "clip_scale_kernel")(
        (1,), (32,), (sumsq_value, np.float32(max_norm), np.float32(scale), out))


def bias_fill(ctx, b, y) -> None:
    """y (R, C) = b (C,) on every row (the same dtype, bf16|f32: a copy of b's bits). A biased
    projection starts here and linear_fwd(ctx, ..., accumulate=True) adds x @ w.T in fp32."""
    _build.check("b", b)
    if b.ndim != 1:
        raise ValueError(f"bias_fill takes a 1-D bias, got shape {b.shape}")
    _build.check("y", y, (y.size // max(b.size, 1), b.size), (b.dtype,))
    n = y.size
    if n:
        _build.kernel(ctx, _SRC, _NAMES, f"bias_fill_kernel<{_build.ctype(b.dtype, 'b')}>")(
            (_build.flat_grid(ctx, n, _THREADS),), (_THREADS,),
            (b, y, np.int64(n // b.size), np.int32(b.size)))


def bias_bwd(ctx, dy, db) -> None:
    """db (C,) bf16|f32 += sum over the rows of dy (R, C) bf16|f32, summed in fp32 in a fixed
    order (the same bits every run) and rounded once."""
    _build.check("dy", dy)
    if dy.ndim != 2:
        raise ValueError(f"bias_bwd takes dy as (rows, columns), got shape {dy.shape}")
    _build.check("db", db, (dy.shape[1],))
    rows, cols = dy.shape
    if cols == 0:
        return
    name = (f"bias_bwd_kernel<{_build.ctype(dy.dtype, 'dy')}, "
            f"{_build.ctype(db.dtype, 'db')}>")
    _build.kernel(ctx, _SRC, _NAMES, name)((-(-cols // 32),), (32, 8),
                                      (dy, np.int64(rows), np.int32(cols), db))
