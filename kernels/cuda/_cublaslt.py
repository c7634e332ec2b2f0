"""Row-major GEMMs through cuBLASLt with the algorithm chosen once per shape bucket, for loops of
GEMMs whose sizes change from call to call: the MoE experts' (kernels/cuda/moe_experts.py), whose
row counts are new every layer and chunk. cuBLAS's gemmEx runs its algorithm heuristics for every
shape it has not seen (its cache keys on exact sizes), about 100 us of host time a call: the
olmoe-1b-7b demo spent 78 % of its step inside those calls (twenty-first session, py-spy), and
fresh row counts made one layer's expert GEMMs 80 ms of host time against 7 ms for repeated ones
(bench/records/s21-*/, gemm probe). Here each dimension is rounded up to a bucket (4 per octave),
the heuristics run once per bucket, and every later GEMM of that bucket calls cublasLtMatmul
with the cached algorithm: a few microseconds of host time.

Semantics are _cublas.gemm's (fp32 compute, no TF32, bf16 or fp32 output, beta = 1 to
accumulate) and the results are a valid cuBLAS algorithm's, so they may differ in the last bits
from gemmEx's choice for the exact shape; the same bucket always gets the same algorithm, so a
run repeats its bits. Split-K algorithms may sum their parts only in fp32 (the workspace), so C
is rounded once, never part by part in bf16. An algorithm that refuses a size of its bucket is
replaced by the exact shape's heuristic (cached too). Workspace: the one _cublas.set_workspace gave
the handle (the engine's arena view; GEMMs on one stream run one after another), else none. The
handle and every cache live in the CudaContext (kernels/cuda/context.py) and are destroyed by its
close(). Never synchronises; never allocates device memory."""

from __future__ import annotations

import ctypes

# CuPy and _cublas are imported where used, so that bucket() imports (and is tested) without a GPU.

_DESC_TRANSA, _DESC_TRANSB = 3, 4                      # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE = 1                                # cublasLtMatmulPreferenceAttributes_t
_PREF_ALIGN = (5, 6, 7, 8)                             # MIN_ALIGNMENT_{A,B,C,D}_BYTES
_PREF_REDUCTION_MASK, _REDUCTION_COMPUTE_TYPE = 3, 2   # ..._REDUCTION_SCHEME_MASK, fp32 partials
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6       # cublasLtMatrixLayoutAttribute_t
_MAX_LAYOUTS = 1 << 16
"""Layouts kept (a few hundred bytes each): one per (type, rows, cols, ld) met."""


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 opaque bytes), its workspace, status."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def bucket(x: int) -> int:
    """The size whose algorithm a GEMM dimension of size x uses: x rounded up to a multiple of
    a quarter of its octave (at least 16): 1..16 -> 16, 17..20 -> 20, ..., 1025..1280 -> 1280.
    Four buckets per octave keep the chosen tile within 25 % of the size it was chosen for."""
    if x <= 16:
        return 16
    step = 1 << max((x - 1).bit_length() - 3, 0)
    return -(-x // step) * step


def _alignment(*ptrs: int) -> int:
    """The largest power of two up to 256 dividing every pointer (bytes)."""
    v = 256
    for p in ptrs:
        v = min(v, p & -p) if p else v
    return v


def _lib(ctx):
    """libcublasLt as loaded by CuPy's libcublas, argtypes set (once per CudaContext)."""
    if ctx.cublaslt_lib is not None:
        return ctx.cublaslt_lib
    from dataflow.kernels.cuda import _cublas  # needs CuPy: see the top

    _cublas.handle(ctx)  # makes sure libcublas (and with it libcublasLt) is loaded
    lib = _cublas.loaded_library(ctx, "libcublasLt.so") or ctypes.CDLL("libcublasLt.so")
    vp, i32, u64, i64, sz = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64,
                             ctypes.c_size_t)
    pvp = ctypes.POINTER(vp)
    lib.cublasLtCreate.argtypes = [pvp]
    lib.cublasLtMatmulDescCreate.argtypes = [pvp, i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [pvp, i32, u64, u64, i64]
    lib.cublasLtMatrixLayoutDestroy.argtypes = [vp]
    lib.cublasLtMatrixLayoutSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [pvp]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, vp,
                                                   ctypes.POINTER(i32)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lib.cublasLtMatmulDescDestroy.argtypes = [vp]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtDestroy.argtypes = [vp]
    ctx.cublaslt_lib = lib
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


class _Device:
    """One device's cuBLASLt handle and caches: matmul descriptors per (op A, op B), layouts per
    (type, rows, cols, ld), preferences per (alignment, workspace), heuristic results per bucket
    key, and per exact call shape what cublasLtMatmul takes. Live as long as their CudaContext
    (destroy); the layouts and calls are bounded (drop_layouts)."""

    def __init__(self, ctx):
        self.lib = lib = _lib(ctx)
        h = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.handle = h.value
        self.descs: dict = {}
        self.layouts: dict = {}
        self.prefs: dict = {}
        self.algos: dict = {}
        self.calls: dict = {}
        """Per (A/B type, C type, workspace): exact sizes -> everything a call passes."""

    def drop_layouts(self) -> None:
        """Destroy every layout and forget the calls that use them (sizes seen so far exceed
        _MAX_LAYOUTS: the caches stay bounded however many row counts a run meets)."""
        for lay in self.layouts.values():
            self.lib.cublasLtMatrixLayoutDestroy(lay)
        self.layouts.clear()
        for calls in self.calls.values():
            calls.clear()

    def destroy(self) -> None:
        """Destroy every descriptor, layout and preference, then the handle (no GEMM of this
        device may still be queued)."""
        self.drop_layouts()
        for d in self.descs.values():
            self.lib.cublasLtMatmulDescDestroy(d)
        for p in self.prefs.values():
            self.lib.cublasLtMatmulPreferenceDestroy(p)
        self.descs.clear()
        self.prefs.clear()
        self.algos.clear()
        self.calls.clear()
        self.lib.cublasLtDestroy(self.handle)

    def desc(self, op_a: int, op_b: int) -> int:
        d = self.descs.get((op_a, op_b))
        if d is None:
            from dataflow.kernels.cuda import _cublas  # needs CuPy: see the top

            p = ctypes.c_void_p()
            _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(p), _cublas._COMPUTE_32F,
                                                     _cublas._CUDA_R_32F), "MatmulDescCreate")
            for attr, op in ((_DESC_TRANSA, op_a), (_DESC_TRANSB, op_b)):
                v = ctypes.c_int32(op)
                _check(self.lib.cublasLtMatmulDescSetAttribute(p, attr, ctypes.byref(v), 4),
                       "MatmulDescSetAttribute")
            d = self.descs[(op_a, op_b)] = p.value
        return d

    def layout(self, dtype: int, rows: int, cols: int, ld: int, count: int = 1,
               stride: int = 0) -> int:
        key = (dtype, rows, cols, ld, count, stride)
        lay = self.layouts.get(key)
        if lay is None:
            p = ctypes.c_void_p()
            _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(p), dtype, rows, cols, ld),
                   "MatrixLayoutCreate")
            if count != 1:
                for attr, v in ((_LAYOUT_BATCH_COUNT, ctypes.c_int32(count)),
                                (_LAYOUT_BATCH_STRIDE, ctypes.c_int64(stride))):
                    _check(self.lib.cublasLtMatrixLayoutSetAttribute(
                        p, attr, ctypes.byref(v), ctypes.sizeof(v)), "MatrixLayoutSetAttribute")
            lay = self.layouts[key] = p.value
        return lay

    def pref(self, align: int, workspace: int) -> int:
        p = self.prefs.get((align, workspace))
        if p is None:
            q = ctypes.c_void_p()
            _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(q)), "PreferenceCreate")
            ws = ctypes.c_uint64(workspace)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                q, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "PreferenceSetAttribute")
            al = ctypes.c_uint32(align)
            for attr in _PREF_ALIGN:
                _check(self.lib.cublasLtMatmulPreferenceSetAttribute(q, attr, ctypes.byref(al), 4),
                       "PreferenceSetAttribute")
            # Split-K partial products may only be summed in fp32 (in the workspace), never in
            # C's own bf16 (in place, or the output-type scheme): C is rounded once, as gemmEx's
            # product is, also where the GEMM accumulates into a bf16 gradient.
            red = ctypes.c_uint32(_REDUCTION_COMPUTE_TYPE)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                q, _PREF_REDUCTION_MASK, ctypes.byref(red), 4), "PreferenceSetAttribute")
            p = self.prefs[(align, workspace)] = q.value
        return p

    def heuristic(self, desc, la, lb, lc, pref, what: str) -> _HeuristicResult:
        res, n = _HeuristicResult(), ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, lc, lc, pref,
                                                         1, ctypes.byref(res), ctypes.byref(n))
        if status != 0 or n.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for {what} (status {status})")
        return res


def _device(ctx) -> _Device:
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    d = ctx.cublaslt.get(dev)
    if d is None:
        d = ctx.cublaslt[dev] = _Device(ctx)
    return d


def destroy(ctx) -> None:
    """Destroy the cuBLASLt handles and caches of the CudaContext `ctx` (its close())."""
    import cupy

    for dev, d in list(ctx.cublaslt.items()):
        with cupy.cuda.Device(dev):
            d.destroy()
    ctx.cublaslt.clear()


def gemm_loop(ctx, ab_dtype, c_dtype):
    """launch(m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate, batch=None) for a
    loop of GEMMs of one operand and one output dtype on the current stream and device, through
    the cuBLASLt handle and caches of the CudaContext `ctx`, as
    _cublas.gemm: C (m, n) [+]= op(A) (m, k) @ op(B) (k, n), row-major, pointers and leading
    dimensions in elements; a call with m or n = 0 launches nothing (k = 0 is refused by
    cuBLASLt). batch = (count, stride of A, of B, of C), strides in elements (0: every product
    reads the same matrix; C's must not be 0 nor any negative): `count` such products of one
    size in one call, the i-th at the pointers + i strides. The dtype checks, the stream and the
    workspace are looked up once here; a call then costs one dict lookup (its exact sizes:
    descriptor, layouts and the bucket's algorithm) and the ctypes call."""
    import cupy

    from dataflow.kernels.cuda import _cublas  # needs CuPy: see the top

    ta = _cublas._dtype_code(ab_dtype, "A and B")
    tc = _cublas._dtype_code(c_dtype, "C")
    if ta == _cublas._CUDA_R_32F and tc != _cublas._CUDA_R_32F:
        raise TypeError("fp32 GEMM operands need an fp32 output")
    dev = _device(ctx)
    handle, matmul = dev.handle, dev.lib.cublasLtMatmul
    stream = cupy.cuda.get_current_stream().ptr
    ws_ptr, ws_size = _cublas.workspace(ctx)
    one, zero = ctx.one_ptr, ctx.zero_ptr
    calls = dev.calls.setdefault((ta, tc, ws_size), {})
    isz_ab, isz_c = (4 if ta == _cublas._CUDA_R_32F else 2), (4 if tc == _cublas._CUDA_R_32F else 2)

    def launch(m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate, batch=None):
        if not (m and n):
            return
        align = _alignment(a, b, c) if (a | b | c) & 255 else 256
        if batch is not None:  # every product's pointers: the strides' alignment too
            align = _alignment(align, batch[1] * isz_ab, batch[2] * isz_ab, batch[3] * isz_c)
        key = (m, n, k, lda, ldb, ldc, trans_a, trans_b, align, batch)
        e = calls.get(key)
        if e is None:
            e = _prepare(dev, calls, ta, tc, ws_size, key)
        # Column-major view of the row-major product: C^T (n, m) = op(B)^T (n, k) @ op(A)^T.
        status = matmul(handle, e[0], one, b, e[1], a, e[2], one if accumulate else zero, c,
                        e[3], c, e[3], e[4], ws_ptr, ws_size, stream)
        if status != 0:  # the bucket's algorithm refuses this size: the exact shape's instead
            e = _prepare(dev, calls, ta, tc, ws_size, key, exact=True)
            _check(matmul(handle, e[0], one, b, e[1], a, e[2], one if accumulate else zero, c,
                          e[3], c, e[3], e[4], ws_ptr, ws_size, stream), "cublasLtMatmul")

    return launch


def _layouts(dev: _Device, ta: int, tc: int, m, n, k, lda, ldb, ldc, trans_a, trans_b,
             batch=None):
    """The cuBLASLt layouts (column-major) of B as the first operand, A as the second, C."""
    count, sa, sb, sc = batch or (1, 0, 0, 0)
    la = dev.layout(ta, k if trans_b else n, n if trans_b else k, ldb, count, sb)
    lb = dev.layout(ta, m if trans_a else k, k if trans_a else m, lda, count, sa)
    lc = dev.layout(tc, n, m, ldc, count, sc)
    return la, lb, lc


def _prepare(dev: _Device, calls: dict, ta: int, tc: int, ws_size: int, key: tuple,
             exact: bool = False) -> tuple:
    """calls[key] = (descriptor, layout of B, of A, of C, algorithm address, its result) for
    key's exact sizes, the algorithm being its size bucket's (heuristics run once per bucket;
    exact: this shape's own, when the bucket's refused it)."""
    m, n, k, lda, ldb, ldc, trans_a, trans_b, align, batch = key
    if batch is not None and (batch[0] < 1 or batch[3] <= 0 or min(batch[1:]) < 0):
        raise ValueError(f"batch {batch}: a positive count, strides >= 0 and C's > 0")
    bm, bn, bk = (m, n, k) if exact else (bucket(m), bucket(n), bucket(k))
    # A bucketed size that is a layout's row count must still fit its leading dimension.
    bn = bn if bn <= ldc and (trans_b or bn <= ldb) else n
    bk = bk if (not trans_b or bk <= ldb) and (trans_a or bk <= lda) else k
    bm = bm if not trans_a or bm <= lda else m
    desc = dev.desc(1 if trans_b else 0, 1 if trans_a else 0)
    akey = (ta, tc, ws_size, bm, bn, bk, lda, ldb, ldc, trans_a, trans_b, align, batch)
    res = dev.algos.get(akey)
    if res is None:
        res = dev.algos[akey] = dev.heuristic(
            desc, *_layouts(dev, ta, tc, bm, bn, bk, lda, ldb, ldc, trans_a, trans_b, batch),
            dev.pref(align, ws_size), f"a ({m}, {n}, {k}) GEMM (bucket ({bm}, {bn}, {bk}))")
    if len(dev.layouts) > _MAX_LAYOUTS:
        dev.drop_layouts()
    entry = (desc, *_layouts(dev, ta, tc, m, n, k, lda, ldb, ldc, trans_a, trans_b, batch),
             ctypes.addressof(res), res)  # res kept alive beside its address
    calls[key] = entry
    return entry
