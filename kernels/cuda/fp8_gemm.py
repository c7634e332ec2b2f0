"""FP8 GEMMs through cuBLASLt on Hopper: row-major C (M, N) [+]= (A (M, K) @ B (N, K).T) times
the two dequantisation scales, A and B FP8 (uint8 CuPy arrays of E4M3 or E5M2 bytes, each with
the (1 / scale, scale, amax) triple kernels/cuda/fp8.py wrote on the device), C bf16 or fp32,
fp32 accumulation. Both operands are K-contiguous: that is the only form ("TN" in cuBLASLt's
column-major terms) Hopper's FP8 GEMMs take, so a linear layer's backward passes the transposed
copies fp8.cast writes. The scales are read on the device (cuBLASLt's A/B scale pointers), so
nothing waits on the host. E5M2 x E5M2 is refused (cuBLASLt has no such kernel).

Semantics against dataflow.kernels.reference.fp8.fp8_matmul: the same products summed in fp32 in
the library's order (FAST_ACCUM off by default: Hopper's fast FP8 accumulation drops low bits
of partial sums, fine for a forward, worse for gradients), scaled once, rounded once to C's type
(beta = 1 adds C in fp32 before that rounding). The algorithm is chosen once per exact shape
and cached in the CudaContext with its descriptor (one per scale-pointer pair and flag: the
engine's scales live at fixed arena addresses). Never synchronises; never allocates."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from dataflow.kernels.cuda import _build, _cublaslt
from dataflow.kernels.cuda.fp8 import U8, device_format, require_fp8

_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18    # cublasLtMatmulDescAttributes_t
_DESC_FAST_ACCUM = 25
_OP_N, _OP_T = 0, 1


def _desc(dev, a_inv: int, b_inv: int, fast_accum: bool) -> int:
    """A matmul descriptor (fp32 compute and scale) for cuBLASLt's A = our B transposed, its
    B = our A, with the dequantisation pointers of each; kept among the device's descriptors
    (destroyed with them), one per pointer pair and flag."""
    from dataflow.kernels.cuda import _cublas  # needs CuPy's libcublas loaded: _cublaslt's rule

    key = ("fp8", a_inv, b_inv, fast_accum)
    d = dev.descs.get(key)
    if d is not None:
        return d
    lib, p = dev.lib, ctypes.c_void_p()
    _cublaslt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(p), _cublas._COMPUTE_32F,
                                                  _cublas._CUDA_R_32F), "MatmulDescCreate")
    attrs = ((_DESC_TRANSA, ctypes.c_int32(_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_OP_N)),
             (_DESC_A_SCALE_POINTER, ctypes.c_void_p(b_inv)),
             (_DESC_B_SCALE_POINTER, ctypes.c_void_p(a_inv)),
             (_DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0)))
    for attr, v in attrs:
        _cublaslt._check(lib.cublasLtMatmulDescSetAttribute(p, attr, ctypes.byref(v),
                                                            ctypes.sizeof(v)),
                         f"MatmulDescSetAttribute({attr})")
    dev.descs[key] = p.value
    return p.value


def fp8_gemm(ctx, a, a_fmt, a_scales, b, b_fmt, b_scales, c, accumulate: bool = False,
             fast_accum: bool = False) -> None:
    """c (M, N) [+]= (a (M, K) @ b (N, K).T) * a_scales[0] * b_scales[0] on the current stream;
    a, b uint8 FP8 of formats a_fmt / b_fmt ('e4m3' | 'e5m2'), c bf16|f32. M, N, K multiples of
    16 and every pointer 16-byte aligned (cuBLASLt's FP8 rules)."""
    import cupy

    from dataflow.kernels.cuda import _cublas  # needs CuPy: see _cublaslt's top

    fa, fb = device_format(a_fmt), device_format(b_fmt)
    require_fp8()
    if fa.e5 and fb.e5:
        raise ValueError("an FP8 GEMM of two E5M2 operands has no cuBLASLt kernel; quantise "
                         "one of them to E4M3")
    _build.check("a", a, None, (U8,))
    _build.check("b", b, None, (U8,))
    _build.check("c", c)
    (m, k), (n, kb) = a.shape, b.shape
    if kb != k or tuple(c.shape) != (m, n):
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} @ b {tuple(b.shape)}.T -> c "
                         f"{tuple(c.shape)} do not agree")
    if m % 16 or n % 16 or k % 16:
        raise ValueError(f"fp8_gemm needs M, N, K multiples of 16; got ({m}, {n}, {k})")
    for name, arr in (("a", a), ("b", b), ("c", c), ("a_scales", a_scales),
                      ("b_scales", b_scales)):
        if arr.data.ptr % 16:
            raise ValueError(f"fp8_gemm: {name} must start on a 16-byte boundary")
    dev = _cublaslt._device(ctx)
    tc = _cublas._dtype_code(c.dtype, "C")
    desc = _desc(dev, a_scales.data.ptr, b_scales.data.ptr, fast_accum)
    ws_ptr, ws_size = _cublas.workspace(ctx)
    # Among the device's calls, so that dropping its layouts forgets these entries too.
    calls = dev.calls.setdefault(("fp8", ws_size), {})
    align = _cublaslt._alignment(a.data.ptr, b.data.ptr, c.data.ptr)
    key = (m, n, k, fa.cuda_type, fb.cuda_type, tc, desc, align)
    e = calls.get(key)
    if e is None:
        la = dev.layout(fb.cuda_type, k, n, k)  # our B (N, K) row-major = (K, N) column-major
        lb = dev.layout(fa.cuda_type, k, m, k)
        lc = dev.layout(tc, n, m, n)
        res = dev.heuristic(desc, la, lb, lc, dev.pref(align, ws_size),
                            f"an FP8 ({m}, {n}, {k}) GEMM ({fa.name} x {fb.name})")
        e = calls[key] = (la, lb, lc, ctypes.addressof(res), res)
    one, zero = ctx.one_ptr, ctx.zero_ptr
    stream = cupy.cuda.get_current_stream().ptr
    _cublaslt._check(dev.lib.cublasLtMatmul(
        dev.handle, desc, one, b.data.ptr, e[0], a.data.ptr, e[1], one if accumulate else zero,
        c.data.ptr, e[2], c.data.ptr, e[2], e[3], ws_ptr, ws_size, stream), "cublasLtMatmul")


# -- diagnosis: which configurations this GPU's cuBLASLt accepts (bench/fp8_gemm_probe.py) ----

_PROBE_MNK = (512, 1024, 4096)
PROBE_VARIANTS = (  # (D dtype, scale pointers, their byte offset, FAST_ACCUM set, workspace bytes)
    ("bf16", True, 0, True, 0), ("bf16", True, 4, True, 0), ("bf16", False, 0, False, 0),
    ("bf16", True, 0, False, 0), ("f32", True, 0, True, 0), ("bf16", True, 0, True, 32 << 20),
    ("f32", False, 0, False, 32 << 20))


def _probe_one(cp, ctx, dev, a, b, d_name, scales, offset, fast, ws) -> str:
    from dataflow.kernels.cuda import _cublas  # needs CuPy: see _cublaslt's top

    lib, p = dev.lib, ctypes.c_void_p()
    st = lib.cublasLtMatmulDescCreate(ctypes.byref(p), _cublas._COMPUTE_32F, _cublas._CUDA_R_32F)
    if st:
        return f"DescCreate -> {st}"
    sc = cp.ones(8, cp.float32)
    attrs = [(_DESC_TRANSA, ctypes.c_int32(_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_OP_N))]
    if scales:
        attrs += [(_DESC_A_SCALE_POINTER, ctypes.c_void_p(sc.data.ptr + offset)),
                  (_DESC_B_SCALE_POINTER, ctypes.c_void_p(sc.data.ptr + offset))]
    if fast:
        attrs += [(_DESC_FAST_ACCUM, ctypes.c_int8(0))]
    for attr, v in attrs:
        st = lib.cublasLtMatmulDescSetAttribute(p, attr, ctypes.byref(v), ctypes.sizeof(v))
        if st:
            return f"SetAttribute({attr}) -> {st}"
    dtype = np.dtype(ml_dtypes.bfloat16) if d_name == "bf16" else np.dtype(np.float32)
    M, N, K = _PROBE_MNK
    c = cp.zeros((M, N), dtype)
    tc = _cublas._dtype_code(dtype, "D")
    e4m3 = device_format('e4m3').cuda_type
    la, lb, lc = dev.layout(e4m3, K, N, K), dev.layout(e4m3, K, M, K), dev.layout(tc, N, M, N)
    res, n = _cublaslt._HeuristicResult(), ctypes.c_int(0)
    work = cp.empty(ws, np.uint8) if ws else None
    st = lib.cublasLtMatmulAlgoGetHeuristic(dev.handle, p.value, la, lb, lc, lc, dev.pref(256, ws),
                                            1, ctypes.byref(res), ctypes.byref(n))
    if st or n.value < 1:
        return f"heuristic -> status {st}, {n.value} algorithms"
    st = lib.cublasLtMatmul(dev.handle, p.value, ctx.one_ptr, b.data.ptr, la, a.data.ptr, lb,
                            ctx.zero_ptr, c.data.ptr, lc, c.data.ptr, lc, ctypes.addressof(res),
                            work.data.ptr if ws else 0, ws, cp.cuda.get_current_stream().ptr)
    cp.cuda.runtime.deviceSynchronize()
    lib.cublasLtMatmulDescDestroy(p)
    return f"matmul -> status {st} (algorithm state {res.state}, workspace {res.workspace_size})"


def probe(ctx, variants=PROBE_VARIANTS) -> list:
    """[(variant, what the heuristic and matmul returned)] for each (D dtype, scale pointers
    set, their byte offset, FAST_ACCUM set, workspace bytes) of an E4M3 512 x 1024 x 4096 GEMM
    (synchronises: a diagnostic, never for the hot loop)."""
    import cupy as cp

    dev = _cublaslt._device(ctx)
    m, n, k = _PROBE_MNK
    a = cp.random.randint(0, 100, (m, k)).astype(np.uint8)  # E4M3 bytes of moderate values
    b = cp.random.randint(0, 100, (n, k)).astype(np.uint8)
    return [(v, _probe_one(cp, ctx, dev, a, b, *v)) for v in variants]
