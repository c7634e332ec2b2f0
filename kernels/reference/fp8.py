"""The FP8 recipe of a linear layer, in NumPy (ml_dtypes' float8 types): the definition the FP8
GPU path is to be checked against (issue 53). Never imports anything of ours but this package.

Recipe: E4M3 for what the forward reads (activations x, weights w), E5M2 for gradients dy, whose
range matters more than their precision (Transformer Engine's HYBRID format). Per-tensor current
scaling: each tensor's scale comes from its own amax now, not from a history. Scales are powers
of two, scale = 2^floor(log2(fp8_max / amax)), so multiplying by one is exact in fp32 and the
cast to FP8 (round to nearest even, after clipping to +-fp8_max: E4M3 has no infinity, a larger
value would become NaN) is the only rounding; the price is at most one binade of range. A GEMM
multiplies the FP8 values in fp32 (as the tensor cores accumulate) and divides by the two scales
at the end, once, in fp32.

Edge cases: an all-zero tensor has scale 1 (it quantises to zeros); a tensor with a non-finite
value is refused (ValueError naming it), since its amax would make every scale meaningless; one
huge value among small ones sets the scale for all of them, so the small ones lose precision or
flush to zero (per-tensor scaling's known weakness, bounded by the tests)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np



@dataclasses.dataclass(frozen=True)
class Fp8Format:
    dtype: np.dtype
    max: float
    unit_roundoff: float
    """The largest relative error of rounding a normal value to the format (half its
    epsilon)."""
    half_subnormal: float
    """The largest absolute error of rounding a value below the normal range (half the
    smallest subnormal), before the scale is undone."""


def _format(t) -> Fp8Format:
    info = ml_dtypes.finfo(t)
    return Fp8Format(np.dtype(t), float(info.max), float(info.eps) / 2,
                     float(info.smallest_subnormal) / 2)


E4M3 = _format(ml_dtypes.float8_e4m3fn)
E5M2 = _format(ml_dtypes.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """FP8 values and the scale they were multiplied by: the tensor is values / scale."""

    values: np.ndarray
    scale: float

    def dequantise(self) -> np.ndarray:
        return self.values.astype(np.float32) / np.float32(self.scale)


def fp8_scale(amax: float, fmt: Fp8Format) -> float:
    """The power of two that brings amax to at most fmt's largest value (1 for amax 0)."""
    if amax == 0.0:
        return 1.0
    return float(2.0 ** np.floor(np.log2(fmt.max / amax)))


def quantise(a: np.ndarray, fmt: Fp8Format, name: str = "tensor") -> Fp8Tensor:
    """`a` in FP8 `fmt` under per-tensor current scaling (see the module's docstring)."""
    a32 = np.asarray(a, np.float32)
    amax = float(np.max(np.abs(a32))) if a32.size else 0.0
    if not np.isfinite(amax):
        raise ValueError(f"{name} holds a non-finite value (amax {amax}); FP8 scaling needs a "
                         "finite tensor: the step that made it diverged")
    scale = fp8_scale(amax, fmt)
    return Fp8Tensor(np.clip(a32 * np.float32(scale), -fmt.max, fmt.max).astype(fmt.dtype),
                     scale)


def fp8_matmul(a: Fp8Tensor, b: Fp8Tensor, out_dtype=np.float32) -> np.ndarray:
    """a.values (M, K) @ b.values (K, N) in fp32, divided by both scales once, as out_dtype."""
    prod = a.values.astype(np.float32) @ b.values.astype(np.float32)
    return (prod / np.float32(a.scale * b.scale)).astype(out_dtype)


def fp8_linear_fwd(x: np.ndarray, w: np.ndarray, out_dtype=None):
    """y = x @ w.T with x (T, I) and w (O, I) in E4M3 -> (y in out_dtype (x's dtype by
    default), the quantised x and w the backward reuses)."""
    qx, qw = quantise(x, E4M3, "activations"), quantise(w, E4M3, "weights")
    y = fp8_matmul(qx, Fp8Tensor(qw.values.T, qw.scale), out_dtype or np.asarray(x).dtype)
    return y, qx, qw


def fp8_linear_bwd(qx: Fp8Tensor, qw: Fp8Tensor, dy: np.ndarray, dx_dtype=np.float32):
    """dx = dy @ w (T, I) in dx_dtype and dw = dy.T @ x (O, I) in fp32, with dy in E5M2 and the
    forward's E4M3 x and w."""
    qdy = quantise(dy, E5M2, "output gradients")
    dx = fp8_matmul(qdy, qw, dx_dtype)
    dw = fp8_matmul(Fp8Tensor(qdy.values.T, qdy.scale), qx, np.float32)
    return dx, dw


def rounding_bound(a: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """Per element, the most that quantise(a, fmt) can move it: the unit roundoff of its
    magnitude, or half a subnormal step (undone by the scale) below the normal range."""
    a64 = np.abs(np.asarray(a, np.float64))
    scale = fp8_scale(float(a64.max()) if a64.size else 0.0, fmt)
    return np.maximum(fmt.unit_roundoff * a64, fmt.half_subnormal / scale)
