"""Device probe (twenty-first session, call B): why does the experts' cuBLAS loop cost ~100 us
of host time per GEMM in the olmoe demo but ~15 us in bench.moe_experts_bench? Hypothesis: new
row counts each layer and chunk -> cuBLAS heuristics per call. Measures host enqueue and GPU time
of experts_fwd+experts_bwd at T tokens with (a) one offsets set repeated, (b) a fresh offsets
set each repetition; then (c) the forward's three GEMM kinds as cublasGemmGroupedBatchedEx
(one call per kind, pointer arrays uploaded) against the loop, bits compared."""
import ctypes, os, sys, time
import numpy as np, cupy as cp, ml_dtypes
import dataflow.kernels.cuda as K
from dataflow.kernels.cuda import _cublas

BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
T, D, F, N, KK = int(sys.argv[1]) if len(sys.argv) > 1 else 16384, 2048, 1024, 64, 8
R = T * KK
grad_dt = BF16 if os.environ.get("GRAD", "bf16") == "bf16" else F32
rng = np.random.default_rng(0)

def bf(*s, scale=1.0):
    out = cp.empty(s, BF16); K.cast(cp.random.standard_normal(s, dtype=cp.float32) * scale, out); return out

def offsets_set(seed):
    r = np.random.default_rng(seed)
    # skewed like a router: expert popularity varies per set
    logits = r.standard_normal((T, N)) + r.standard_normal(N) * 0.3
    idx = np.argsort(-logits, axis=1)[:, :KK].astype(np.int64)
    order, off = cp.empty(R, np.int64), cp.empty(N + 1, np.int64)
    K.expert_order(cp.asarray(idx), N, order, off)
    return off.get()

sets = [offsets_set(s) for s in range(24)]
xp, dyp = bf(R, D), bf(R, D)
wg, wu, wd = bf(N, F, D, scale=D ** -0.5), bf(N, F, D, scale=D ** -0.5), bf(N, D, F, scale=F ** -0.5)
dwg, dwu, dwd = cp.zeros((N, F, D), grad_dt), cp.zeros((N, F, D), grad_dt), cp.zeros((N, D, F), grad_dt)
yp, dxp = cp.empty((R, D), BF16), cp.empty((R, D), BF16)
gate, up, h, dgate, dup, act = (cp.empty((R, F), BF16) for _ in range(6))
acc = cp.empty(T * D, F32)
st = cp.cuda.get_current_stream()

def layer(off):
    K.experts_fwd(xp, off, wg, wu, wd, yp, gate, up, h=act)
    K.experts_bwd(xp, off, wg, wu, wd, gate, up, dyp, dxp, dwg, dwu, dwd, dgate=dgate, dup=dup, h=h, dx_acc=acc)

def timed(fn, offs):
    hs, gs = [], []
    for off in offs:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        st.synchronize(); a.record(st); t0 = time.perf_counter()
        fn(off)
        hs.append(time.perf_counter() - t0); b.record(st); b.synchronize()
        gs.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return 1e3 * np.median(hs), 1e3 * np.median(gs), 1e3 * hs[0], 1e3 * gs[0]

layer(sets[0]); st.synchronize()
print(f"T {T} R {R} grad {grad_dt} CUBLASLT_HEURISTICS_CACHE_CAPACITY={os.environ.get('CUBLASLT_HEURISTICS_CACHE_CAPACITY')}")
print("rows per expert: min %d max %d" % (np.diff(sets[0]).min(), np.diff(sets[0]).max()))
print("fixed offsets x8  : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(layer, [sets[0]] * 8))
print("fresh offsets x23 : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(layer, sets[1:]))
print("again same 23     : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(layer, sets[1:]))
try:
    lt = [l.split()[-1] for l in open("/proc/self/maps") if "libcublasLt.so" in l][0]
    c = ctypes.c_size_t(); ctypes.CDLL(lt).cublasLtHeuristicsCacheGetCapacity(ctypes.byref(c)); print("Lt heuristics cache capacity", c.value)
except Exception as e: print("cache capacity query failed", e)

# grouped: forward's three kinds as one call each
lib = _cublas._libcublas()
fn = getattr(lib, "cublasGemmGroupedBatchedEx", None)
print("cublasGemmGroupedBatchedEx:", fn is not None)
if fn is None: sys.exit(0)
h_ = _cublas.handle()
isz = 2
def grouped(m_list, n, k, a_ptrs, lda, trans_a, b_ptrs, ldb, trans_b, c_ptrs, ldc, ctype, beta):
    g = len(m_list)
    I = lambda v: (ctypes.c_int * g)(*v)
    ta = I([1 if trans_b else 0] * g); tb = I([1 if trans_a else 0] * g)
    alpha = (ctypes.c_float * g)(*([1.0] * g)); bet = (ctypes.c_float * g)(*([beta] * g))
    dA = cp.asarray(np.array(b_ptrs, np.uint64)); dB = cp.asarray(np.array(a_ptrs, np.uint64)); dC = cp.asarray(np.array(c_ptrs, np.uint64))
    s = fn(ctypes.c_void_p(h_), ta, tb, I([n] * g), I(m_list), I([k] * g) if not isinstance(k, list) else I(k),
           alpha, ctypes.c_void_p(dA.data.ptr), 14, I([ldb] * g), ctypes.c_void_p(dB.data.ptr), 14, I([lda] * g),
           bet, ctypes.c_void_p(dC.data.ptr), ctype, I([ldc] * g), ctypes.c_int(g), I([1] * g), 68)
    if s != 0: raise RuntimeError(f"grouped status {s}")
    return dA, dB, dC

def fwd_grouped(off):
    act_ = [(e, int(off[e]), int(off[e + 1] - off[e])) for e in range(N) if off[e + 1] > off[e]]
    ms = [n for _, _, n in act_]
    keep = []
    keep.append(grouped(ms, F, D, [xp.data.ptr + r0 * D * isz for _, r0, _ in act_], D, False,
                        [wg.data.ptr + e * F * D * isz for e, _, _ in act_], D, True,
                        [gate.data.ptr + r0 * F * isz for _, r0, _ in act_], F, 14, 0.0))
    keep.append(grouped(ms, F, D, [xp.data.ptr + r0 * D * isz for _, r0, _ in act_], D, False,
                        [wu.data.ptr + e * F * D * isz for e, _, _ in act_], D, True,
                        [up.data.ptr + r0 * F * isz for _, r0, _ in act_], F, 14, 0.0))
    K.swiglu_fwd(gate, up, act)
    keep.append(grouped(ms, D, F, [act.data.ptr + r0 * F * isz for _, r0, _ in act_], F, False,
                        [wd.data.ptr + e * D * F * isz for e, _, _ in act_], F, True,
                        [yp.data.ptr + r0 * D * isz for _, r0, _ in act_], D, 14, 0.0))
    return keep

def fwd_loop(off):
    K.experts_fwd(xp, off, wg, wu, wd, yp, gate, up, h=act)

fwd_loop(sets[3]); ref = (gate.copy(), up.copy(), yp.copy())
gate.fill(0); up.fill(0); yp.fill(0)
fwd_grouped(sets[3]); st.synchronize()
same = [bool((a.view(np.uint16) == b.view(np.uint16)).all()) for a, b in zip(ref, (gate, up, yp))]
print("grouped fwd bits equal loop (gate, up, y):", same)
print("fwd loop    fresh : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(fwd_loop, sets[1:]))
print("fwd grouped fresh : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(fwd_grouped, sets[1:]))
# bwd weight-gradient kind, k varies: dWg (F, D) += dgate^T (F x m) @ x (m x D)
def dw_grouped(off):
    act_ = [(e, int(off[e]), int(off[e + 1] - off[e])) for e in range(N) if off[e + 1] > off[e]]
    ct = 14 if grad_dt == BF16 else 0
    return grouped([F] * len(act_), D, [n for _, _, n in act_],
                   [dgate.data.ptr + r0 * F * isz for _, r0, _ in act_], F, True,
                   [xp.data.ptr + r0 * D * isz for _, r0, _ in act_], D, False,
                   [dwg.data.ptr + e * F * D * grad_dt.itemsize for e, _, _ in act_], D, ct, 1.0)
try:
    dw_grouped(sets[1]); st.synchronize()
    print("dW grouped fresh  : host %.2f ms gpu %.2f ms (first %.2f / %.2f)" % timed(dw_grouped, sets[1:]))
except Exception as e:
    print("dW grouped failed:", e)
