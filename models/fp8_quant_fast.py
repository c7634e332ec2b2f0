"""The FP8 base's quantiser compiled by numba, rows in parallel: the bits of
models.fp8_quant.quantise_rows (its NumPy reference; tests/models/test_fp8_quant_fast.py compares
them on fresh random weights, ties and the subnormal range included), about 20x faster on the
host's cores. A 70b base is 70e9 weights: the reference's ~40 M a second would take half an hour
at load. Host-side maths only: never touches a device, never decides placement."""

from __future__ import annotations

import numba
import numpy as np

_MAX = np.float32(448.0)  # E4M3's largest finite value (models.fp8_layout.E4M3_MAX)
_MIN_NORMAL_BITS = np.uint32(0x3C800000)  # 2^-6, E4M3's smallest normal, as fp32 bits


@numba.njit(cache=True, inline="always")
def _e4m3(bits, value):
    """The E4M3 code of fp32 `value` (finite, |value| <= 448; `bits` its fp32 bits), rounded to
    nearest even as ml_dtypes casts: below 2^-6 a multiple of 2^-9 (the subnormals; 8 of them
    is the smallest normal's code), else the mantissa's 20 low bits rounded away."""
    sign = np.uint8((bits >> np.uint32(24)) & np.uint32(0x80))
    a = bits & np.uint32(0x7FFFFFFF)
    if a < _MIN_NORMAL_BITS:
        return sign | np.uint8(np.rint(abs(value) * np.float32(512.0)))
    r = (a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
    return sign | np.uint8((((r >> np.uint32(23)) - np.uint32(120)) << np.uint32(3))
                           | ((r >> np.uint32(20)) & np.uint32(7)))


@numba.njit(cache=True, inline="always")
def _row_f32(x, i, out, bits16):
    """Row i of `x` as fp32 values in `out`: bf16 bits (uint16, `bits16`) shifted into the high
    half (exact), or fp32 copied."""
    if bits16:
        bits = out.view(np.uint32)
        for j in range(x.shape[1]):
            bits[j] = np.uint32(x[i, j]) << np.uint32(16)
    else:
        for j in range(x.shape[1]):
            out[j] = x[i, j]


@numba.njit(parallel=True, cache=True)
def _encode_rows(x, codes, scales, bad, bits16):
    """Row i of `x` (O, I: bf16 bits as uint16 when `bits16`, else fp32) -> codes[i] (uint8),
    scales[i] (fp32); bad[i] = True for a row holding inf or NaN (its codes and scale are then left as
    they were)."""
    rows, cols = x.shape
    for i in numba.prange(rows):
        row = np.empty(cols, np.float32)
        _row_f32(x, i, row, bits16)
        amax = np.float32(0.0)
        for j in range(cols):
            v = row[j]
            if not np.isfinite(v):
                bad[i] = True
            a = abs(v)
            if a > amax:
                amax = a
        if bad[i]:
            continue
        s = amax / _MAX if amax > np.float32(0.0) else np.float32(1.0)
        scales[i] = s
        for j in range(cols):
            row[j] = min(max(row[j] / s, -_MAX), _MAX)
        qb = row.view(np.uint32)
        for j in range(cols):
            codes[i, j] = _e4m3(qb[j], row[j])


def quantise_rows_fast(w, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """As models.fp8_quant.quantise_rows, bit for bit: (codes (O, I) uint8, scales (O,) fp32)
    of an (O, I) weight (bf16, as ml_dtypes stores it, or any float NumPy casts to fp32);
    ValueError naming `name` and the first row holding inf or NaN."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"{name}: a weight to quantise is (out, in), got shape {w.shape}")
    if str(w.dtype) == "bfloat16":
        x = np.ascontiguousarray(w).view(np.uint16)
    else:
        x = np.ascontiguousarray(w, dtype=np.float32)
    codes = np.empty(x.shape, np.uint8)
    scales = np.empty(x.shape[0], np.float32)
    bad = np.zeros(x.shape[0], np.bool_)
    if x.size:
        _encode_rows(x, codes, scales, bad, x.dtype == np.uint16)
    else:
        scales[:] = 1.0
    if bad.any():
        raise ValueError(f"{name}: row {int(np.argmax(bad))} holds inf or NaN; an fp8 base needs "
                         "finite weights (fix the checkpoint, or use --lora-base bf16)")
    return codes, scales
