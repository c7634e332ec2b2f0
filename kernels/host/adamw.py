"""AdamW over a whole block on the CPU, in parallel pieces: bf16 param/m/v (as uint16 bits), bf16
or fp32 grad, fp32 math in exactly dataflow.kernels.reference.adamw_step's order, so the host optimizer and
the NumPy device path give identical bits. Updates in place; never allocates more than one
piece of fp32 scratch per thread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from dataflow.kernels.host._bf16 import as_f32, bf16_to_f32, f32_to_bf16

_PIECE = 1 << 14
_WORKERS = max(1, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="host-adamw")
"""numba releases the GIL (nogil=True), so plain threads run the pieces in parallel."""


@numba.njit(nogil=True, cache=True)
def _adamw(p, g, m, v, b1, b2, one_m_b1, one_m_b2, bc1, bc2, lr, wd, eps, scale, start, stop):
    # One pass per piece: unpack to fp32 scratch, update element by element in registers (the
    # reference's operation order, fp32 throughout), pack back.
    pf = np.empty(_PIECE, dtype=np.float32)
    mf = np.empty(_PIECE, dtype=np.float32)
    vf = np.empty(_PIECE, dtype=np.float32)
    for a in range(start, stop, _PIECE):
        z = min(stop, a + _PIECE)
        n = z - a
        gf = as_f32(g[a:z])
        pf[:n] = bf16_to_f32(p[a:z])
        mf[:n] = bf16_to_f32(m[a:z])
        vf[:n] = bf16_to_f32(v[a:z])
        for i in range(n):
            gi = gf[i] * scale
            mi = b1 * mf[i] + one_m_b1 * gi
            vi = b2 * vf[i] + one_m_b2 * gi * gi
            pi = pf[i]
            pf[i] = pi - lr * (wd * pi + (mi / bc1) / (np.sqrt(vi / bc2) + eps))
            mf[i] = mi
            vf[i] = vi
        p[a:z] = f32_to_bf16(pf[:n])
        m[a:z] = f32_to_bf16(mf[:n])
        v[a:z] = f32_to_bf16(vf[:n])


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
