"""Rotary position embedding on the GPU (kernels/cuda/rope.cu), half-split convention of
transformers' Llama (`rotate_half`: dimension j pairs with j + E/2, inverse frequency
theta ** (-2j / E)); matches kernels.reference.rope. Angles pos * inv_freq are formed in fp64
inside the kernel, as the reference does, so phase does not drift at long positions; nothing
is precomputed or cached per call. Enqueued on the current CuPy stream; no sync, no allocation."""

from __future__ import annotations

import numpy as np

from kernels.cuda import _build
from kernels.cuda._build import I32

_SRC = "rope.cu"
_NAMES = tuple(f"rope_kernel<{t}, {v}>" for t in ("bf16", "float") for v in (1, 8))
_THREADS = 256


def _rope(x, positions, theta: float, out, sign: float) -> None:
    if x.ndim != 3:
        raise ValueError(f"rope takes x (T, n_heads, E); got shape {tuple(x.shape)}")
    t, n, e = x.shape
    _build.check("x", x, (t, n, e))
    _build.check("out", out, (t, n, e), (x.dtype,))
    _build.check("positions", positions, (t,), (I32,))
    if e % 2:
        raise ValueError(f"rope needs an even head_dim, got {e}")
    half = e // 2
    vec = 8 if half % 8 == 0 and _build.aligned16(x, out) else 1
    packs_per_tok = n * (half // vec)
    tpb = max(1, _THREADS // packs_per_tok)
    smem = 2 * tpb * half * 4
    if smem > 48 * 1024:
        raise ValueError(f"rope head_dim {e} is too large for this kernel (cos/sin tile {smem} B)")
    k = _build.kernel(_SRC, _NAMES, f"rope_kernel<{_build.ctype(x.dtype, 'x')}, {vec}>")
    if t:
        k((-(-t // tpb),), (_THREADS,),
          (x, positions, out, np.int32(t), np.int32(n), np.int32(e), np.int32(tpb),
           np.float64(theta), np.float32(sign)), shared_mem=smem)


def rope_fwd(x, positions, theta: float, out) -> None:
    """x (T, n, E) bf16|f32, positions (T,) int32 device array -> out (T, n, E), same dtype.

    out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin (x1 = x[..., :E/2]); out may be x.
    """
    _rope(x, positions, theta, out, 1.0)


def rope_bwd(dy, positions, theta: float, out) -> None:
    """dy (T, n, E) -> out (T, n, E): the transposed rotation (angle -> -angle); out may be dy."""
    _rope(dy, positions, theta, out, -1.0)
