"""FP8 quantisation on the device under the recipe of dataflow.kernels.reference.fp8 (per-tensor
current scaling, power-of-two scales, E4M3 or E5M2): the amax and the scale from it, then the
cast and, for the backward's GEMMs, the transpose in the same pass. The FP8 bytes equal the
reference's exactly (the scale is exact, the cast rounds to nearest even and saturates as the
reference clips). FP8 arrays are uint8 CuPy arrays holding the format's bytes (view them as
ml_dtypes' float8 types on the host). Enqueued on the current CuPy stream; never synchronises;
allocates only its per-stream amax scratch on first use when the caller passes none."""

from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import F32

_SRC = "fp8.cu"
_TYPES = ("bf16", "float")
_NAMES = tuple(
    [f"fp8_amax_partial<{s}, {v}>" for s in _TYPES for v in (1, 8)]
    + ["fp8_scale_finish"]
    + [f"fp8_cast<{s}, {e}>" for s in _TYPES for e in (0, 1)]
)
_THREADS = 256
AMAX_PARTS = 1024
"""Most first-stage blocks of the amax; its scratch holds this many fp32 values."""
U8 = np.dtype(np.uint8)


@dataclasses.dataclass(frozen=True)
class DeviceFormat:
    """An FP8 format as the kernels and cuBLASLt name it."""

    name: str
    max_exp: int
    """The format's largest value is 0.875 * 2^max_exp (448 for E4M3, 57344 for E5M2)."""
    cuda_type: int
    """cudaDataType_t: CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29 (library_types.h)."""
    e5: int


E4M3 = DeviceFormat("e4m3", 9, 28, 0)
E5M2 = DeviceFormat("e5m2", 16, 29, 1)
FORMATS = (E4M3, E5M2)


def device_format(fmt) -> DeviceFormat:
    """'e4m3' | 'e5m2' | a DeviceFormat -> the DeviceFormat."""
    if isinstance(fmt, DeviceFormat):
        return fmt
    for f in FORMATS:
        if f.name == fmt:
            return f
    raise ValueError(f"FP8 format {fmt!r}; choose one of {', '.join(f.name for f in FORMATS)}")


def require_fp8() -> None:
    """Raise unless the current device has FP8 tensor cores and conversions (sm_89+)."""
    cc = int(cupy.cuda.Device().compute_capability)
    if cc < 89:
        raise RuntimeError(f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                           f"this one is {cc // 10}.{cc % 10}: train in bf16 (--precision bf16)")


def _vec(*arrays) -> int:
    return 8 if _build.aligned16(*arrays) else 1


def amax_scale(ctx, x, fmt, scales, scratch=None) -> None:
    """scales (3,) f32 device = (1 / scale, scale, amax) of x (bf16|f32, any shape) for `fmt`
    (see fp8.cu; NaN scales for a non-finite x). The dequantisation factor comes first: it is
    what the GEMMs read, and cuBLASLt wants its FP8 pointers 16-byte aligned."""
    f = device_format(fmt)
    _build.check("x", x)
    _build.check("scales", scales, (3,), (F32,))
    if scratch is None:
        key = ("fp8_amax", cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
        scratch = ctx.scratch.get(key)
        if scratch is None:
            scratch = ctx.scratch[key] = cupy.empty(AMAX_PARTS, dtype=F32)
    elif scratch.dtype != F32 or scratch.size < AMAX_PARTS:
        raise ValueError(f"amax scratch must be fp32 with >= {AMAX_PARTS} values")
    v, n = _vec(x), x.size
    parts = max(1, min(AMAX_PARTS, -(-n // (v * _THREADS * 4))))
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_amax_partial<{_build.ctype(x.dtype, 'x')}, {v}>")(
        (parts,), (_THREADS,), (x, np.int64(n), scratch))
    _build.kernel(ctx, _SRC, _NAMES, "fp8_scale_finish")(
        (1,), (1024,), (scratch, np.int32(parts), np.int32(f.max_exp), scales))


def cast(ctx, x, fmt, scales, out, out_t=None) -> None:
    """out (R, C) uint8 = fmt(x * scales[1]) for x (R, C) bf16|f32, and out_t (C, R) its
    transpose when given (out may then be None: the transpose alone). R and C must be
    multiples of 16 (FP8 GEMMs need it too)."""
    f = device_format(fmt)
    require_fp8()
    _build.check("x", x)
    if x.ndim != 2 or x.shape[0] % 16 or x.shape[1] % 16:
        raise ValueError(f"FP8 cast takes a 2-D tensor with both sizes multiples of 16; got "
                         f"shape {tuple(x.shape)}")
    rows, cols = x.shape
    _build.check("scales", scales, (3,), (F32,))
    if out is None and out_t is None:
        raise ValueError("FP8 cast needs out, out_t or both")
    if out is not None:
        _build.check("out", out, (rows, cols), (U8,))
    if out_t is not None:
        _build.check("out_t", out_t, (cols, rows), (U8,))
    for name, a in (("x", x), ("out", out), ("out_t", out_t)):
        if a is not None and a.data.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")
    grid = (-(-cols // 64), -(-rows // 64))
    null = np.uint64(0)  # a null pointer: that layout is not written
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_cast<{_build.ctype(x.dtype, 'x')}, {f.e5}>")(
        grid, (16, 16), (x, scales, null if out is None else out,
                         null if out_t is None else out_t, np.int32(rows), np.int32(cols)))


def quantise(ctx, x, fmt, scales, out, out_t=None, scratch=None) -> None:
    """amax_scale then cast: x in FP8 with its scales (and its transpose when out_t is given)."""
    amax_scale(ctx, x, fmt, scales, scratch)
    cast(ctx, x, fmt, scales, out, out_t)
