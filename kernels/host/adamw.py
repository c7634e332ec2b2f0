"""AdamW over a whole block on the CPU, in parallel pieces: bf16 param/m/v (as uint16 bits), bf16
or fp32 grad, fp32 math in exactly dataflow.kernels.reference.adamw_step's order, so the host optimizer and
the NumPy device path give identical bits. Updates in place; never allocates more than one
piece of uint32 scratch per thread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from numba import types
from numba.extending import overload

_PIECE = 1 << 14
_WORKERS = max(1, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="host-adamw")
"""numba releases the GIL (nogil=True), so plain threads run the pieces in parallel."""


def _grad_f32(g, a, n, scratch):
    """g[a:a + n] as fp32 inside numba code: bf16 bits unpacked into `scratch` (uint32), fp32 as
    it is (no copy)."""
    raise NotImplementedError("only called from numba-compiled code")


@overload(_grad_f32, inline="always")
def _grad_f32_impl(g, a, n, scratch):
    # chosen by the array's type at compile time (as _bf16.as_f32): one cache entry per dtype
    if g.dtype == types.uint16:
        def unpack(g, a, n, scratch):
            for i in range(n):
                scratch[i] = np.uint32(g[a + i]) << np.uint32(16)
            return scratch.view(np.float32)
        return unpack
    return lambda g, a, n, scratch: g[a:a + n]


@numba.njit(nogil=True, cache=True, inline="always")
def _to_bf16(bits, x):
    """fp32 `x` (its bits `bits`) to bf16 bits: round to nearest even, NaN kept (_bf16.f32_to_bf16
    element by element)."""
    if x != x:
        return np.uint16(0x7FC0)
    one, sixteen = np.uint32(1), np.uint32(16)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> sixteen) & one)) >> sixteen)


@numba.njit(nogil=True, cache=True)
def _adamw(p, g, m, v, b1, b2, one_m_b1, one_m_b2, bc1, bc2, lr, wd, eps, scale, start, stop):
    # Per piece: unpack into uint32 scratch seen as fp32, update element by element in registers
    # (the reference's operation order, fp32 throughout), pack back, all in scalar loops. Array
    # conversions (astype, shifts, masks) allocated several temporaries a piece and ran the
    # whole update at ~20 M parameters/s a core.
    pu = np.empty(_PIECE, dtype=np.uint32)
    mu = np.empty(_PIECE, dtype=np.uint32)
    vu = np.empty(_PIECE, dtype=np.uint32)
    gu = np.empty(_PIECE, dtype=np.uint32)
    pf, mf, vf = pu.view(np.float32), mu.view(np.float32), vu.view(np.float32)
    sixteen = np.uint32(16)
    for a in range(start, stop, _PIECE):
        z = min(stop, a + _PIECE)
        n = z - a
        gf = _grad_f32(g, a, n, gu)
        for i in range(n):
            pu[i] = np.uint32(p[a + i]) << sixteen
            mu[i] = np.uint32(m[a + i]) << sixteen
            vu[i] = np.uint32(v[a + i]) << sixteen
        for i in range(n):
            gi = gf[i] * scale
            mi = b1 * mf[i] + one_m_b1 * gi
            vi = b2 * vf[i] + one_m_b2 * gi * gi
            pi = pf[i]
            pf[i] = pi - lr * (wd * pi + (mi / bc1) / (np.sqrt(vi / bc2) + eps))
            mf[i] = mi
            vf[i] = vi
        for i in range(n):
            p[a + i] = _to_bf16(pu[i], pf[i])
            m[a + i] = _to_bf16(mu[i], mf[i])
            v[a + i] = _to_bf16(vu[i], vf[i])


def adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale) -> None:
    """Same arguments and result as dataflow.ops_numpy.adamw_step; param, m, v bf16 1-D arrays,
    grad bf16 or fp32."""
    if step < 1:
        raise ValueError(f"AdamW step counts from 1, got {step}")
    f = np.float32
    g = grad if grad.dtype == np.float32 else grad.view(np.uint16)
    scale = float(np.asarray(grad_scale).ravel()[0])
    args = (param.view(np.uint16), g, m.view(np.uint16), v.view(np.uint16), f(beta1), f(beta2), f(1 - beta1),
            f(1 - beta2), f(1 - beta1 ** step), f(1 - beta2 ** step), f(lr), f(weight_decay),
            f(eps), f(scale))
    n = param.size
    if n <= _PIECE * 4:
        _adamw(*args, 0, n)
        return
    per = -(-(-(-n // _WORKERS)) // _PIECE) * _PIECE
    futures = [_POOL.submit(_adamw, *args, a, min(n, a + per)) for a in range(0, n, per)]
    for fut in futures:
        fut.result()
