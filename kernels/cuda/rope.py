"""Rotary position embedding on the GPU (kernels/cuda/rope.cu), half-split convention of
transformers' Llama (`rotate_half`: dimension j pairs with j + E/2); matches dataflow.kernels.reference.rope.
The inverse frequencies are the reference's own float64 table (dataflow.kernels.reference.rope_inv_freq:
plain or Llama 3.1-scaled), passed to the kernel by value as a kernel parameter, so the GPU uses
bit-identical frequencies and nothing is allocated on the device. Angles pos * inv_freq are
formed in fp64 inside the kernel, as the reference does, so phase does not drift at long
positions. Enqueued on the current CuPy stream; no sync, no device allocation."""

from __future__ import annotations

import functools

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import I32
from dataflow.kernels.reference.rope import rope_inv_freq

_SRC = "rope.cu"
_NAMES = tuple(f"rope_kernel<{t}, {v}>" for t in ("bf16", "float") for v in (1, 8))
_THREADS = 256
MAX_HALF = 128
"""Entries of the kernel's RopeInvFreq parameter (rope.cu ROPE_MAX_HALF): head_dim <= 256."""
_FREQ = np.dtype([("v", np.float64, (MAX_HALF,))])


def freq_param(inv_freq, head_dim: int) -> np.ndarray:
    """The kernel's RopeInvFreq argument: a one-element host struct array (CuPy passes size-one
    NumPy arrays by value) holding inv_freq (E/2,) float64, zero padded; a number is taken as
    plain RoPE's theta. Build it once and pass it to rope_fwd/rope_bwd to skip the packing."""
    if isinstance(inv_freq, np.ndarray) and inv_freq.dtype == _FREQ:
        return inv_freq
    if np.ndim(inv_freq) == 0:
        return _plain_param(float(inv_freq), head_dim)
    table = np.asarray(inv_freq, dtype=np.float64)
    half = head_dim // 2
    if table.shape != (half,):
        raise ValueError(f"rope inv_freq has shape {table.shape}, head_dim {head_dim} needs "
                         f"({half},); build it with dataflow.kernels.reference.rope_inv_freq")
    if half > MAX_HALF:
        raise ValueError(f"rope head_dim {head_dim} is above this kernel's {2 * MAX_HALF}")
    param = np.zeros(1, _FREQ)
    param["v"][0, :half] = table
    return param


@functools.lru_cache(maxsize=32)
def _plain_param(theta: float, head_dim: int) -> np.ndarray:
    param = freq_param(rope_inv_freq(head_dim, theta), head_dim)
    param.setflags(write=False)
    return param


def _rope(ctx, x, positions, inv_freq, out, sign: float) -> None:
    if x.ndim != 3:
        raise ValueError(f"rope takes x (T, n_heads, E); got shape {tuple(x.shape)}")
    t, n, e = x.shape
    _build.check("x", x, (t, n, e))
    _build.check("out", out, (t, n, e), (x.dtype,))
    _build.check("positions", positions, (t,), (I32,))
    if e % 2:
        raise ValueError(f"rope needs an even head_dim, got {e}")
    half = e // 2
    if half > MAX_HALF:
        raise ValueError(f"rope head_dim {e} is above this kernel's {2 * MAX_HALF}")
    param = freq_param(inv_freq, e)
    vec = 8 if half % 8 == 0 and _build.aligned16(x, out) else 1
    packs_per_tok = n * (half // vec)
    tpb = max(1, _THREADS // packs_per_tok)
    smem = 2 * tpb * half * 4
    if smem > 48 * 1024:
        raise ValueError(f"rope head_dim {e} is too large for this kernel (cos/sin tile {smem} B)")
    k = _build.kernel(ctx, _SRC, _NAMES, f"rope_kernel<{_build.ctype(x.dtype, 'x')}, {vec}>")
    if t:
        k((-(-t // tpb),), (_THREADS,),
          (x, positions, out, np.int32(t), np.int32(n), np.int32(e), np.int32(tpb),
           param, np.float32(sign)), shared_mem=smem)


def rope_fwd(ctx, x, positions, inv_freq, out) -> None:
    """x (T, n, E) bf16|f32, positions (T,) int32 device array, inv_freq (E/2,) float64 host
    array from dataflow.kernels.reference.rope_inv_freq (or freq_param's packed form, or a number:
    plain RoPE's theta) -> out (T, n, E), same dtype.

    out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin (x1 = x[..., :E/2]); out may be x.
    """
    _rope(ctx, x, positions, inv_freq, out, 1.0)


def rope_bwd(ctx, dy, positions, inv_freq, out) -> None:
    """dy (T, n, E) -> out (T, n, E): the transposed rotation (angle -> -angle); out may be dy.
    inv_freq as for rope_fwd."""
    _rope(ctx, dy, positions, inv_freq, out, -1.0)
