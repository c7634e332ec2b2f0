"""AdamW on the GPU (kernels/cuda/adamw.cu): one launch over a whole flat block, in place, fp32
math, vectorised loads; matches dataflow.kernels.reference.adamw. Enqueued on the current CuPy stream; no
sync, no allocation."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import F32

_SRC = "adamw.cu"
_TYPES = ("bf16", "float")
_NAMES = tuple(f"adamw_kernel<{p}, {g}, {m}, {v}>" for p in _TYPES for g in _TYPES
               for m in _TYPES for v in (1, 8))
_THREADS = 256


def adamw_step(ctx, param, grad, m, v, *, step: int, lr: float, beta1: float = 0.9,
               beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
               grad_scale: float = 1.0, grad_scale_dev=None) -> None:
    """param bf16|f32, grad bf16|f32, m and v bf16|f32 (same dtype), all the same size: updated
    in place; step >= 1 counts updates including this one.

    The gradient is multiplied by grad_scale and, when given, by the device scalar
    grad_scale_dev ((1,) f32, e.g. utils.clip_scale's output), read on the device.
    """
    if step < 1:
        raise ValueError(f"AdamW step counts from 1, got {step}")
    _build.check("param", param)
    for what, a in (("grad", grad), ("m", m), ("v", v)):
        _build.check(what, a)
        if a.size != param.size:
            raise ValueError(f"{what} has {a.size} elements; param has {param.size}")
    if v.dtype != m.dtype:
        raise TypeError(f"m and v must share a dtype; got {m.dtype} and {v.dtype}")
    if grad_scale_dev is None:
        scale_ptr = np.uint64(0)
    else:
        _build.check("grad_scale_dev", grad_scale_dev, None, (F32,))
        scale_ptr = grad_scale_dev
    vec = 8 if _build.aligned16(param, grad, m, v) else 1
    name = (f"adamw_kernel<{_build.ctype(param.dtype, 'param')}, "
            f"{_build.ctype(grad.dtype, 'grad')}, {_build.ctype(m.dtype, 'm')}, {vec}>")
    n = param.size
    f32 = np.float32
    if n:
        _build.kernel(ctx, _SRC, _NAMES, name)(
            (_build.flat_grid(ctx, -(-n // vec), _THREADS),), (_THREADS,),
            (param, grad, m, v, np.int64(n), f32(lr), f32(beta1), f32(1 - beta1), f32(beta2),
             f32(1 - beta2), f32(eps), f32(weight_decay), f32(1 - beta1 ** step),
             f32(1 - beta2 ** step), f32(grad_scale), scale_ptr))
