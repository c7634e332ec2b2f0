"""Which split-K reduction scheme cuBLASLt's first heuristic picks for the shapes of
tests/kernels/test_cublaslt.py's changing-sizes test (bf16 A/B, bf16 C), with every scheme allowed
(7, cuBLASLt's default) and with fp32 partials only (2, _cublaslt's preference since s22)."""
import ctypes

import ml_dtypes
import numpy as np

from dataflow.kernels.cuda import _cublas
from dataflow.kernels.cuda import _cublaslt as L

BF16 = np.dtype(ml_dtypes.bfloat16)
dev = L._device()
ta = tc = _cublas._dtype_code(BF16, "A")


def pref(ws: int, mask: int) -> int:
    q = ctypes.c_void_p()
    dev.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(q))
    for attr, v, n in ((1, ctypes.c_uint64(ws), 8), (3, ctypes.c_uint32(mask), 4)):
        dev.lib.cublasLtMatmulPreferenceSetAttribute(q, attr, ctypes.byref(v), n)
    al = ctypes.c_uint32(256)
    for attr in (5, 6, 7, 8):
        dev.lib.cublasLtMatmulPreferenceSetAttribute(q, attr, ctypes.byref(al), 4)
    return q.value


def cfg(res, attr: int) -> int:
    v, w = ctypes.c_uint32(0), ctypes.c_size_t(0)
    dev.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(res.algo), attr, ctypes.byref(v), 4,
                                                 ctypes.byref(w))
    return v.value


print("m n k trans_a trans_b ws mask -> splitk reduction_scheme")
for m, n, k in [(1, 48, 64), (7, 40, 72), (300, 64, 136), (17, 200, 8), (1025, 96, 64),
                (130, 64, 1000), (2048, 2048, 1024), (1024, 2048, 2048)]:
    for trans_a, trans_b in [(False, False), (False, True), (True, False)]:
        lda = m if trans_a else k
        ldb = k if trans_b else n
        desc = dev.desc(1 if trans_b else 0, 1 if trans_a else 0)
        lays = L._layouts(dev, ta, tc, m, n, k, lda, ldb, n, trans_a, trans_b)
        for ws in (0, 32 << 20):
            row = []
            for mask in (7, 2):
                try:
                    res = dev.heuristic(desc, *lays, pref(ws, mask), "probe")
                    row.append(f"mask {mask}: splitk {cfg(res, 2)} scheme {cfg(res, 3)}")
                except RuntimeError as exc:
                    row.append(f"mask {mask}: {exc}")
            print(m, n, k, trans_a, trans_b, ws, " | ".join(row))
