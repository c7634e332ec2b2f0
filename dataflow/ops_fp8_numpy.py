"""The NumPy op table in FP8 precision: the bf16 table (dataflow.ops_numpy) with the linear
layers' three GEMMs in the FP8 recipe of dataflow.kernels.reference.fp8 (E4M3 activations and
weights, E5M2 output gradients, per-tensor current scaling with power-of-two scales, fp32
products scaled once). Every linear op quantises its own inputs, so a tensor used by two ops is
quantised twice to the same bytes, as one quantisation would give. Only the block projections
(q, k, v, o, gate, up, down: layer_ops' linear_* calls) change; the embedding, norms, attention,
the head and loss, the MoE experts and AdamW stay as the bf16 table computes them, and so does a
GEMM with a size that is not a multiple of 16 (fp8_shapes_fit: the GPU's rule). A non-finite
input does not raise here (the reference's quantise would): the op's output is NaN, so the step
is seen as non-finite and dropped, as on the GPU. Never allocates arena memory."""

from __future__ import annotations

import types

import numpy as np

from dataflow import ops_numpy
from dataflow.kernels.reference import fp8 as ref_fp8

F32 = np.float32


def _q(a, fmt):
    """a in FP8 `fmt` (an Fp8Tensor), or None when a holds a non-finite value."""
    if a.size and not np.isfinite(np.max(np.abs(a.astype(F32)))):
        return None
    return ref_fp8.quantise(a, fmt)


def _gemm(dst, a, b, accumulate: bool) -> None:
    """dst (=|+=) a @ b.T for FP8 tensors a (M, K), b (N, K): fp32 products, scaled once, the
    accumulation in fp32 and one rounding to dst's dtype (cuBLASLt's beta = 1); NaN for a
    non-finite input."""
    if a is None or b is None:
        dst[...] = np.nan
        return
    prod = ref_fp8.fp8_matmul(a, ref_fp8.Fp8Tensor(b.values.T, b.scale), F32)
    ops_numpy._store(dst, prod, accumulate)


def fp8_shapes_fit(*sizes: int) -> bool:
    """Whether a GEMM of these sizes runs in FP8: cuBLASLt's FP8 GEMMs take sizes that are
    multiples of 16 only, so any other runs the bf16 op, here as on the GPU
    (dataflow.ops_cuda_fp8)."""
    return all(s > 0 and s % 16 == 0 for s in sizes)


def linear_fwd(x, w, y, accumulate=False, alpha=1.0):
    """y (=|+=) x @ w.T with x and w in E4M3; a scaled product (alpha: LoRA's adapters, never
    a projection) runs the bf16 op."""
    if alpha != 1.0:
        return ops_numpy.linear_fwd(x, w, y, accumulate, alpha)
    if not fp8_shapes_fit(*x.shape, w.shape[0]):
        return ops_numpy.linear_fwd(x, w, y, accumulate)
    _gemm(y, _q(x, ref_fp8.E4M3), _q(w, ref_fp8.E4M3), accumulate)


def linear_bwd_x(dy, w, dx, accumulate=False, alpha=1.0):
    """dx (=|+=) dy @ w with dy in E5M2 and w in E4M3 (alpha != 1: the bf16 op, as above)."""
    if alpha != 1.0:
        return ops_numpy.linear_bwd_x(dy, w, dx, accumulate, alpha)
    if not fp8_shapes_fit(*dy.shape, w.shape[1]):
        return ops_numpy.linear_bwd_x(dy, w, dx, accumulate)
    qw = _q(w, ref_fp8.E4M3)
    wt = None if qw is None else ref_fp8.Fp8Tensor(np.ascontiguousarray(qw.values.T), qw.scale)
    _gemm(dx, _q(dy, ref_fp8.E5M2), wt, accumulate)


def linear_bwd_w(dy, x, dw, accumulate=True):
    """dw (=|+=) dy.T @ x with dy in E5M2 and x in E4M3."""
    if not fp8_shapes_fit(*dy.shape, x.shape[1]):
        return ops_numpy.linear_bwd_w(dy, x, dw, accumulate)
    qdy, qx = _q(dy, ref_fp8.E5M2), _q(x, ref_fp8.E4M3)
    dyt = None if qdy is None else ref_fp8.Fp8Tensor(np.ascontiguousarray(qdy.values.T),
                                                     qdy.scale)
    xt = None if qx is None else ref_fp8.Fp8Tensor(np.ascontiguousarray(qx.values.T), qx.scale)
    _gemm(dw, dyt, xt, accumulate)


FP8_LINEAR_OPS = ("linear_fwd", "linear_bwd_x", "linear_bwd_w")


def op_table() -> types.SimpleNamespace:
    """The bf16 table's ops with the FP8 linear ops in place of its own (WRITES unchanged)."""
    table = {name: getattr(ops_numpy, name) for name in ops_numpy.WRITES}
    table.update({name: globals()[name] for name in FP8_LINEAR_OPS})
    return types.SimpleNamespace(**table)
