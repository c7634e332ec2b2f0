"""FP8 quantisation on the device under the recipe of dataflow.kernels.reference.fp8 (per-tensor
current scaling, power-of-two scales, E4M3 or E5M2): the amax and the scale from it, then the
cast and, for the backward's GEMMs, the transpose in the same pass; or, guessed
(quantise_guessed), the cast with the scale a tensor of the same site had last time, the amax
taken on the way, and a second cast only where the guess missed: one pass over x where it holds.
The FP8 bytes equal the reference's exactly either way (the scale is exact, the cast rounds to
nearest even and saturates as the reference clips). FP8 arrays are uint8 CuPy arrays holding the
format's bytes (view them as ml_dtypes' float8 types on the host). Enqueued on the current CuPy
stream; never synchronises (guess_counts, a diagnostic, excepted); allocates only its
per-stream amax scratch on first use when the caller passes none."""

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
    + ["fp8_scale_finish", "fp8_scale_check"]
    + [f"{k}<{s}, {e}>" for k in ("fp8_cast", "fp8_cast_amax", "fp8_recast")
       for s in _TYPES for e in (0, 1)]
)
_THREADS = 256
AMAX_PARTS = 1024
"""Most first-stage blocks of the amax; its scratch holds this many fp32 values."""
GUESS_HEADER = 4
"""Words of a guessed quantisation's state before its guesses (fp8.cu: the amax bits, the miss
flag, the checks and misses counted)."""
RECAST_BLOCKS = 4
"""fp8_recast's blocks per SM: a hit (every block returns at once) costs few, a miss has enough
to run the cast at HBM speed."""
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


def _cast_args(x, fmt, scales, out, out_t):
    """Check cast's arguments; (format, rows, cols, the 2-D grid of 64 x 64 tiles)."""
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
    return f, rows, cols, (-(-cols // 64), -(-rows // 64))


_NULL = np.uint64(0)
"""A null pointer: that layout is not written."""


def _outs(out, out_t) -> tuple:
    return _NULL if out is None else out, _NULL if out_t is None else out_t


def cast(ctx, x, fmt, scales, out, out_t=None) -> None:
    """out (R, C) uint8 = fmt(x * scales[1]) for x (R, C) bf16|f32, and out_t (C, R) its
    transpose when given (out may then be None: the transpose alone). R and C must be
    multiples of 16 (FP8 GEMMs need it too)."""
    f, rows, cols, grid = _cast_args(x, fmt, scales, out, out_t)
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_cast<{_build.ctype(x.dtype, 'x')}, {f.e5}>")(
        grid, (16, 16), (x, scales, *_outs(out, out_t), np.int32(rows), np.int32(cols)))


def quantise_guessed(ctx, x, fmt, scales, out, out_t, state, slot: int) -> None:
    """quantise's bytes and scales in one pass over x where the guess holds: the cast runs with
    guess slot `slot`'s scale (the scale the same site had last time: state[GUESS_HEADER +
    slot]) and takes x's amax on the way; the true scales go into `scales`, the slot learns
    them, and only where they differ from the guess is x cast again (fp8.cu). state: the fp32
    (GUESS_HEADER + slots,) device array, zeros before its first use, one per stream of
    quantisations (its header is shared by each quantisation's three kernels)."""
    f, rows, cols, grid = _cast_args(x, fmt, scales, out, out_t)
    if state.dtype != F32 or state.ndim != 1 or not 0 <= slot < state.size - GUESS_HEADER:
        raise ValueError(f"guess slot {slot} outside the fp32 state of {state.size} values "
                         f"(its first {GUESS_HEADER} are the header)")
    s = _build.ctype(x.dtype, "x")
    guess, words = state[GUESS_HEADER + slot:GUESS_HEADER + slot + 1], state.view(np.uint32)
    outs = _outs(out, out_t)
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_cast_amax<{s}, {f.e5}>")(
        grid, (16, 16), (x, guess, *outs, np.int32(rows), np.int32(cols), words))
    _build.kernel(ctx, _SRC, _NAMES, "fp8_scale_check")(
        (1,), (1,), (words, np.int32(f.max_exp), scales, guess))
    blocks = min(grid[0] * grid[1], RECAST_BLOCKS * _build.sm_count(ctx))
    _build.kernel(ctx, _SRC, _NAMES, f"fp8_recast<{s}, {f.e5}>")(
        (blocks,), (16, 16), (x, scales, *outs, np.int32(rows), np.int32(cols), words))


def guess_counts(state) -> tuple[int, int]:
    """(checks, misses) a guess state has counted (a device-to-host copy: synchronises)."""
    words = cupy.asnumpy(state[:GUESS_HEADER].view(np.uint32))
    return int(words[2]), int(words[3])


def quantise(ctx, x, fmt, scales, out, out_t=None, scratch=None) -> None:
    """amax_scale then cast: x in FP8 with its scales (and its transpose when out_t is given)."""
    amax_scale(ctx, x, fmt, scales, scratch)
    cast(ctx, x, fmt, scales, out, out_t)
