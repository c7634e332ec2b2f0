"""The op table for the CuPy backend: the same names, signatures and semantics as
dataflow.ops_numpy, implemented by kernels.cuda. Adapts the few places where the CUDA kernels'
conventions differ (cuDNN writes bf16 dK/dV that the engine accumulates in fp32; AdamW takes
keywords). Library scratch (cuDNN workspaces, reduction scratch, the bf16 dK/dV of a context)
is allocated once per shape on first use and reported by `library_workspace_bytes()`; it lives
outside the budgeted arena, like the CUDA context. Never decides placement."""

from __future__ import annotations

import cupy as cp

import kernels.cuda as K
from dataflow.ops_numpy import WRITES  # noqa: F401 - same write positions as the NumPy table

rms_norm_fwd = K.rms_norm_fwd
rms_norm_bwd = K.rms_norm_bwd
linear_fwd = K.linear_fwd
linear_bwd_x = K.linear_bwd_x
linear_bwd_w = K.linear_bwd_w
rope_fwd = K.rope_fwd
rope_bwd = K.rope_bwd
swiglu_fwd = K.swiglu_fwd
swiglu_bwd = K.swiglu_bwd
embedding_fwd = K.embedding_fwd
embedding_bwd = K.embedding_bwd
head_loss_fwd_bwd = K.head_loss_fwd_bwd
_ARENA_WORKSPACE: list = [None]
"""The unused tail of the device arena, lent to cuDNN as its workspace (set by the executor);
cuDNN allocates its own only for a graph that needs more than the tail holds."""


def bind_arena_workspace(view) -> None:
    _ARENA_WORKSPACE[0] = view


def attention_fwd(q, k, v, q_offset, o, lse):
    K.attention_fwd(q, k, v, q_offset, o, lse, workspace=_ARENA_WORKSPACE[0])
add_ = K.add_
cast = K.cast
fill_ = K.fill_
sumsq = K.sumsq

_SCRATCH: dict[tuple, cp.ndarray] = {}


def _scratch(name: str, shape, dtype) -> cp.ndarray:
    """A view of `shape` into one flat buffer per (device, name), grown only when a larger shape
    arrives (the backward meets the longest context first, so it grows at most once)."""
    key = (cp.cuda.runtime.getDevice(), name, str(dtype))
    n = 1
    for s in shape:
        n *= s
    buf = _SCRATCH.get(key)
    if buf is None or buf.size < n:
        buf = _SCRATCH[key] = cp.empty(n, dtype=dtype)
    return buf[:n].reshape(shape)


def library_workspace_bytes() -> int:
    """Bytes of scratch this table allocated outside the arena (bf16 dK/dV buffers)."""
    return sum(b.nbytes for b in _SCRATCH.values())


def attention_bwd(q, k, v, o, lse, do, q_offset, dq, dk, dv):
    """dq overwritten; dk and dv (fp32, whole context) accumulate (+=), as in ops_numpy."""
    dk16 = _scratch("dk", k.shape, k.dtype)
    dv16 = _scratch("dv", v.shape, v.dtype)
    # Deterministic (bit-reproducible) when a chunk attends to itself only; a chunk attending
    # to a longer context uses the atomic dQ algorithm, whose workspace does not grow with
    # T*S (memplan.buffers.attention_workspace_bytes sizes the arena the same way).
    K.attention_bwd(q, k, v, o, lse, do, q_offset, dq, dk16, dv16,
                    deterministic=k.shape[0] == q.shape[0], workspace=_ARENA_WORKSPACE[0])
    K.add_(dk, dk16)
    K.add_(dv, dv16)


def adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    K.adamw_step(param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, grad_scale=float(grad_scale))
