"""Row-major GEMMs through cuBLAS gemmEx (bf16 or fp32 operands, fp32 compute, bf16 or fp32
output, beta = 1 to accumulate). One cuBLAS handle per device and CudaContext, created on first
use, kept in the context and destroyed by its close(); CuPy's binding points the handle at the
current CuPy stream before every call. Never synchronises; cuBLAS keeps its own workspace
(library memory, outside the engine's arena) unless set_workspace gave it one. The MoE experts'
loops of changing sizes use _cublaslt instead."""

from __future__ import annotations

import ctypes
import os

import cupy
import numpy as np
from cupy_backends.cuda.libs import cublas

from dataflow.kernels.cuda._build import BF16, F32

_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_COMPUTE_32F = 68          # CUBLAS_COMPUTE_32F: fp32 accumulation, no TF32 down-conversion
_GEMM_DEFAULT = -1         # CUBLAS_GEMM_DEFAULT: cuBLAS picks the (tensor-core) algorithm
_OP_N, _OP_T = 0, 1


def handle(ctx) -> int:
    """This device's cuBLAS handle in the CudaContext `ctx` (created once)."""
    dev = cupy.cuda.runtime.getDevice()
    h = ctx.cublas_handles.get(dev)
    if h is None:
        h = ctx.cublas_handles[dev] = cublas.create()
    return h


def destroy_handles(ctx) -> None:
    """Destroy every cuBLAS handle of `ctx` (its close(): no GEMM of it may still be queued)."""
    for dev, h in list(ctx.cublas_handles.items()):
        with cupy.cuda.Device(dev):
            cublas.destroy(h)
    ctx.cublas_handles.clear()
    ctx.cublas_workspaces.clear()


def set_workspace(ctx, view) -> None:
    """Point this device's cuBLAS handle of `ctx` at `view` (a device byte array the caller
    keeps alive) as its workspace, so cuBLAS allocates none of its own (cublasSetWorkspace);
    _cublaslt's GEMMs use it too. None takes it back (workspace NULL, 0 bytes): call that before
    the memory is freed, or a later GEMM may write into memory that is gone (an engine's arena
    outlives the handle; the twenty-first session's GPU tests hit an illegal address that way)."""
    dev = cupy.cuda.runtime.getDevice()
    ptr, n = (0, 0) if view is None else (view.data.ptr, int(view.nbytes))
    if view is None:
        ctx.cublas_workspaces.pop(dev, None)
    else:
        ctx.cublas_workspaces[dev] = (ptr, n)
    fn = getattr(cublas, "setWorkspace", None)
    if fn is not None:
        fn(handle(ctx), ptr, n)
        return
    lib = _libcublas(ctx)
    status = lib.cublasSetWorkspace_v2(ctypes.c_void_p(handle(ctx)), ctypes.c_void_p(ptr),
                                       ctypes.c_size_t(n))
    if status != 0:
        raise RuntimeError(f"cublasSetWorkspace failed with status {status}")


def workspace(ctx) -> tuple[int, int]:
    """(pointer, bytes) of the workspace set_workspace gave this device's handle of `ctx`, or
    (0, 0): _cublaslt's GEMMs use the same memory (GEMMs of one stream run one after another)."""
    return ctx.cublas_workspaces.get(cupy.cuda.runtime.getDevice(), (0, 0))


def loaded_library(ctx, prefix: str):
    """ctypes handle of the shared library whose file name starts with `prefix` (e.g.
    "libcublas.so", "libcublasLt.so") that this process already loaded, found through
    /proc/self/maps, or None. Found once, then cached in `ctx` (with the engine's pinned host
    memory mapped, that file is long); a library not loaded yet is looked for again next time."""
    lib = ctx.libraries.get(prefix)
    if lib is None:
        with open("/proc/self/maps") as f:
            paths = sorted({p for p in (line.split()[-1] for line in f)
                            if os.path.basename(p).startswith(prefix)})
        if not paths:
            return None
        lib = ctx.libraries[prefix] = ctypes.CDLL(paths[0])
    return lib


def _libcublas(ctx):
    """The libcublas this process already loaded (CuPy's, with this device's handle)."""
    handle(ctx)
    lib = loaded_library(ctx, "libcublas.so")
    if lib is None:
        raise RuntimeError("libcublas is not loaded; call a cuBLAS op first")
    return lib


def _dtype_code(dtype, what: str) -> int:
    dtype = np.dtype(dtype)
    if dtype == BF16:
        return _CUDA_R_16BF
    if dtype == F32:
        return _CUDA_R_32F
    raise TypeError(f"{what} has dtype {dtype}; the GEMMs take bfloat16 or float32")


def gemm(ctx, m: int, n: int, k: int,
         a: int, a_dtype, lda: int, trans_a: bool,
         b: int, b_dtype, ldb: int, trans_b: bool,
         c: int, c_dtype, ldc: int, accumulate: bool, alpha: float = 1.0) -> None:
    """Row-major C (m, n) [+]= alpha * op(A) (m, k) @ op(B) (k, n), on the current CuPy stream,
    through the handle of the CudaContext `ctx` (alpha is cuBLAS's: it scales the fp32 product
    before the one rounding to C's dtype; alpha 1 passes the context's `one` as always).

    a, b, c are device pointers; lda/ldb/ldc are row strides in elements of the stored
    matrices (A is stored (m, k), or (k, m) when trans_a; B (k, n), or (n, k) when trans_b).
    cuBLAS is column-major, so this computes C^T = op(B)^T op(A)^T: B goes first.
    """
    if m == 0 or n == 0:
        return
    ta, tb = _dtype_code(a_dtype, "A"), _dtype_code(b_dtype, "B")
    if ta != tb:
        raise TypeError(f"GEMM operands differ in dtype: {a_dtype} and {b_dtype}")
    tc = _dtype_code(c_dtype, "C")
    if ta == _CUDA_R_32F and tc != _CUDA_R_32F:
        raise TypeError("fp32 GEMM operands need an fp32 output")
    one = ctx.one_ptr
    scale = one if alpha == 1.0 else ctx.scalar_ptr(alpha)
    cublas.gemmEx(handle(ctx), _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
                  n, m, k, scale, b, tb, ldb, a, ta, lda,
                  one if accumulate else ctx.zero_ptr, c, tc, ldc, _COMPUTE_32F, _GEMM_DEFAULT)
