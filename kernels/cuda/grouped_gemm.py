"""Many row-major GEMMs of different sizes in one cuBLAS call (cublasGemmGroupedBatchedEx, cuBLAS
12.5 and later), one group per problem, each as _cublas.gemm: C (m, n) [+]= op(A) (m, k) @ op(B)
(k, n), bf16 or fp32 operands and the same output dtype (bf16 in, fp32 out is refused: cuBLAS
13.0 answers it NOT_SUPPORTED), fp32 compute, pointers and leading dimensions in elements. cuBLAS
reads the sizes from host arrays and the pointers from device arrays, so the caller must know
the sizes on the host: it does not remove the MoE block's wait for its routing offsets
(kernels/cuda/moe_experts.py), only the loop of launches. A probe for issue 55 so far: the
engine's expert loop does not use it; bench/cublas_grouped_probe.py measures it against
_cublaslt.gemm_loop. prepare() copies the pointer arrays to the device (a small pageable copy the
host waits for); launch() enqueues on the current CuPy stream and never synchronises."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import cupy
import numpy as np

from dataflow.kernels.cuda import _cublas

_P, _I = ctypes.c_void_p, ctypes.c_int
_ARGTYPES = (_P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _I)


def _function(ctx):
    """The library's cublasGemmGroupedBatchedEx with its argument types, or None (cuBLAS < 12.5)."""
    fn = getattr(_cublas._libcublas(ctx), "cublasGemmGroupedBatchedEx", None)
    if fn is not None and fn.argtypes is None:
        fn.argtypes, fn.restype = list(_ARGTYPES), _I
    return fn


def available(ctx) -> bool:
    """Whether this process's cuBLAS has the grouped GEMM."""
    return _function(ctx) is not None


@dataclass(frozen=True)
class GroupedCall:
    """One call's arrays in cuBLAS's column-major view (C^T = op(B)^T op(A)^T: B goes first):
    host int32 / float32 arrays per group and device uint64 pointer arrays per problem."""

    trans_b: np.ndarray
    trans_a: np.ndarray
    n: np.ndarray
    m: np.ndarray
    k: np.ndarray
    alpha: np.ndarray
    ldb: np.ndarray
    lda: np.ndarray
    beta: np.ndarray
    ldc: np.ndarray
    sizes: np.ndarray
    b_ptrs: cupy.ndarray
    a_ptrs: cupy.ndarray
    c_ptrs: cupy.ndarray
    ab_type: int
    c_type: int


def prepare(problems, ab_dtype, c_dtype) -> GroupedCall:
    """The arrays of one call over `problems`, each (m, n, k, a, lda, trans_a, b, ldb, trans_b,
    c, ldc, accumulate); problems with m, n or k of 0 are refused (leave them out: an empty
    product either writes nothing or, with k = 0 and no accumulate, zeros that the caller
    writes itself)."""
    ta = _cublas._dtype_code(ab_dtype, "A and B")
    tc = _cublas._dtype_code(c_dtype, "C")
    if ta != tc:
        # cuBLAS 13.0 on an H100 returned CUBLAS_STATUS_NOT_SUPPORTED (15) for bf16 operands
        # with an fp32 output (s36): the loop (_cublaslt.gemm_loop) takes that mix
        raise TypeError(f"the grouped GEMM takes one dtype for A, B and C; got "
                        f"{np.dtype(ab_dtype)} operands and {np.dtype(c_dtype)} output (use "
                        "_cublaslt.gemm_loop)")
    empty = [q[:3] for q in problems if not (q[0] and q[1] and q[2])]
    if empty or not problems:
        raise ValueError(f"grouped GEMM problems need m, n, k >= 1 and at least one problem; "
                         f"got {len(problems)} problems, sizes {empty[:4]}")

    def col(i, fn=int, dtype=np.int32):
        return np.asarray([fn(q[i]) for q in problems], dtype)

    op = lambda t: _cublas._OP_T if t else _cublas._OP_N  # noqa: E731
    dev = lambda i: cupy.asarray(np.asarray([q[i] for q in problems], np.uint64))  # noqa: E731
    return GroupedCall(
        trans_b=col(8, op), trans_a=col(5, op), n=col(1), m=col(0), k=col(2),
        alpha=np.ones(len(problems), np.float32), ldb=col(7), lda=col(4),
        beta=col(11, lambda acc: 1.0 if acc else 0.0, np.float32), ldc=col(10),
        sizes=np.ones(len(problems), np.int32), b_ptrs=dev(6), a_ptrs=dev(3), c_ptrs=dev(9),
        ab_type=ta, c_type=tc)


def launch(ctx, g: GroupedCall) -> None:
    """Enqueue the grouped call `g` on the current CuPy stream through `ctx`'s cuBLAS handle."""
    fn = _function(ctx)
    if fn is None:
        raise RuntimeError("this cuBLAS has no cublasGemmGroupedBatchedEx (needs cuBLAS 12.5+)")
    from cupy_backends.cuda.libs import cublas

    h = _cublas.handle(ctx)
    cublas.setStream(h, cupy.cuda.get_current_stream().ptr)
    d = lambda a: a.ctypes.data  # noqa: E731
    status = fn(h, d(g.trans_b), d(g.trans_a), d(g.n), d(g.m), d(g.k), d(g.alpha),
                g.b_ptrs.data.ptr, g.ab_type, d(g.ldb), g.a_ptrs.data.ptr, g.ab_type, d(g.lda),
                d(g.beta), g.c_ptrs.data.ptr, g.c_type, d(g.ldc), len(g.m), d(g.sizes),
                _cublas._COMPUTE_32F)
    if status != 0:
        raise RuntimeError(f"cublasGemmGroupedBatchedEx failed with status {status} "
                           f"({len(g.m)} groups)")
