"""Token permutation to experts and back (kernels/cuda/moe_experts.cu) and the routed experts'
SwiGLU over variable row counts (a loop of cuBLAS GEMMs per expert plus the existing swiglu
kernel), forward and backward; matches dataflow.kernels.reference.moe_experts function by
function. Output buffers and scratch are passed in; all work is enqueued on the current CuPy
stream. Never decides routing and never synchronises: the one host-device sync of the MoE block
is offsets_to_host, which the caller runs and waits on explicitly.

The host's cost. Each expert's GEMMs take a few microseconds of GPU time at OLMoE's shapes (64
experts, ~2,000 rows each at 16k tokens), and their row counts are new every layer and chunk.
cuBLAS's gemmEx runs its algorithm heuristics for every shape it has not seen, about 100 us of
host time a call: the olmoe-1b-7b demo spent 78 % of its step there. So the loop launches them
through _cublaslt.gemm_loop (heuristics once per size bucket, then cublasLtMatmul with the cached
algorithm) on pointers computed from the stacked weights (indexing a CuPy array builds a view,
which costs more host time than the GEMM), and rounds the input gradient of many experts with
one cast. Measured: bench/records/s21-h200-*/ and docs/moe.md.

The sync. The expert loop launches one GEMM per (expert, matrix) with that expert's row count,
so the counts must be on the host. expert_order writes offsets (N + 1,) on the device;
offsets_to_host stores them ((N + 1) * 8 bytes) into a pinned host array, by one small kernel
through the array's device mapping (mapped_address) or else a memcpy, and records an event; the
caller waits on that event, then calls experts_fwd with the host offsets. The memcpy needs a
copy engine, and in the engine it queued behind the weight and gradient transfers: 1.8-3.8 ms
a copy on average where the kernel's store takes 16 us (bench/records/s22-h200-offsets/a/,
olmoe-1b-7b: 27.0k -> 31.8k tok/s). Even so the wait drains the stream: the host can enqueue
nothing past the router of this layer and chunk until the GPU has run everything before it, and
the first expert GEMM then starts after a poll and a launch latency instead of being queued
ahead. The engine waits once per layer and chunk in the forward, the recompute and the backward
(dataflow/ops_cuda_moe.py; keeping the forward's host offsets for the backward would save the
last two). At 16k tokens an OLMoE layer's expert ops take ~3.8 ms forward, so the bubble is a
few percent; at small chunks it dominates (docs/moe.md).

Layout as the reference: order (R,) int64 lists token * k + slot of each routed row, grouped by
expert (stable), offsets (N + 1,) int64, inv (R,) int64 its inverse (inv[order[r]] = r). The
reference's permute_bwd / unpermute_fwd take `order` and invert it inside; these take `inv`
(expert_order writes it, or inverse_order), since an inverse needs an (R,) buffer. Shape legend:
kernels/__init__.py and moe_router (N experts, k per token, R = T * k, F the expert ffn dim)."""

from __future__ import annotations

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32
from dataflow.kernels.cuda._cublaslt import gemm_loop
from dataflow.kernels.cuda.swiglu import swiglu_bwd, swiglu_fwd
from dataflow.kernels.cuda.utils import cast

_SRC = "moe_experts.cu"
_TYPES = ("bf16", "float")
_NAMES = tuple(
    ["expert_count_kernel", "expert_scan_kernel", "expert_place_kernel", "inverse_order_kernel",
     "offsets_to_mapped_kernel",
     "permute_fwd_kernel<uint4>", "permute_fwd_kernel<unsigned short>"]
    + [f"permute_bwd_kernel<{i}, {o}, {v}, {r}>" for i in _TYPES for o in _TYPES
       for v in (1, 8) for r in ("false", "true")]
    + [f"unpermute_fwd_kernel<{t}, {o}, {v}>" for t in _TYPES for o in _TYPES for v in (1, 8)]
    + [f"unpermute_bwd_kernel<{t}, {v}>" for t in _TYPES for v in (1, 8)]
)
I64 = np.dtype(np.int64)
_THREADS = 256
_D2H = 2  # cudaMemcpyDeviceToHost
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


# ---------------------------------------------------------------------------- permutation

def _check_index(what: str, a, shape: tuple[int, ...]) -> None:
    _build.check(what, a, shape, (I64,))


def expert_order(ctx, topk_idx, n_experts: int, order, offsets, inv=None) -> None:
    """topk_idx (T, k) int64 -> order (R,) int64, offsets (N + 1,) int64, and inv (R,) int64
    when given. As reference expert_order (a stable sort of the flat pairs by expert; expert e
    owns rows offsets[e]:offsets[e + 1], zero allowed) plus its inverse. Three launches: counts,
    scan, placement; deterministic.

    Indices must lie in [0, N) (router_fwd guarantees it); the device cannot raise, so a pair
    outside is placed nowhere and offsets[N] < R shows it (experts_fwd checks that on the host).
    """
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be (T, k), got shape {topk_idx.shape}")
    _check_index("topk_idx", topk_idx, topk_idx.shape)
    n_pairs = topk_idx.size
    _check_index("order", order, (n_pairs,))
    _check_index("offsets", offsets, (n_experts + 1,))
    if inv is not None:
        _check_index("inv", inv, (n_pairs,))
    if n_experts < 1:
        raise ValueError(f"n_experts must be positive, got {n_experts}")
    _build.kernel(ctx, _SRC, _NAMES, "expert_count_kernel")(
        (n_experts,), (_THREADS,), (topk_idx, np.int64(n_pairs), offsets))
    _build.kernel(ctx, _SRC, _NAMES, "expert_scan_kernel")((1,), (32,),
                                                           (offsets, np.int32(n_experts)))
    _build.kernel(ctx, _SRC, _NAMES, "expert_place_kernel")(
        (n_experts,), (_THREADS,),
        (topk_idx, np.int64(n_pairs), offsets, order, order if inv is None else inv,
         np.int32(inv is not None)))


def inverse_order(ctx, order, inv) -> None:
    """order (R,) int64 -> inv (R,) int64 with inv[order[r]] = r (reference _inverse): for a
    backward that kept only `order`."""
    n = order.shape[0] if order.ndim == 1 else -1
    _check_index("order", order, (n,))
    _check_index("inv", inv, (n,))
    if n:
        _build.kernel(ctx, _SRC, _NAMES, "inverse_order_kernel")(
            (_build.flat_grid(ctx, n, _THREADS),), (_THREADS,), (order, inv, np.int64(n)))


def mapped_address(out: np.ndarray) -> int | None:
    """The device's address of pinned host array `out` (cudaHostAlloc'd, or inside a
    cudaHostRegister'd range that the driver mapped), or None where the device has none (pageable
    memory, an unmapped registration): offsets_to_host's `mapped`. One runtime query, a few
    microseconds; callers may query once per array."""
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(out.ctypes.data)
    except cupy.cuda.runtime.CUDARuntimeError:
        return None
    if attrs.type != _MEMORY_TYPE_HOST or not attrs.devicePointer:
        return None
    return int(attrs.devicePointer)


def offsets_to_host(ctx, offsets, out: np.ndarray, event=None, *, mapped: int | None = None):
    """Copy offsets (N + 1,) int64 device -> out (N + 1,) int64 host (pinned, e.g.
    cupyx.empty_pinned, for the copy to be asynchronous) on the current stream and record
    `event` (a new cupy.cuda.Event when None) after it; returns the event. THE sync point of the
    MoE block (module docstring): call event.synchronize() before reading `out`. Nothing else
    here reads device memory from the host.

    With `mapped` (mapped_address(out)) one small kernel stores the offsets through the device's
    mapping of `out`; without, cudaMemcpyAsync. The memcpy needs a copy engine, and the engine's
    gradient and weight transfers keep the copy engines busy with copies of hundreds of MB, behind
    which it may queue while the compute stream waits for it; the kernel's stores use none."""
    _check_index("offsets", offsets, offsets.shape)
    if (not isinstance(out, np.ndarray) or out.dtype != I64 or out.shape != offsets.shape
            or not out.flags.c_contiguous):
        raise TypeError(f"out must be a C-contiguous NumPy int64 array of shape {offsets.shape}; "
                        f"got {type(out).__name__} {getattr(out, 'dtype', '')} "
                        f"{getattr(out, 'shape', '')}")
    stream = cupy.cuda.get_current_stream()
    if mapped is None:
        cupy.cuda.runtime.memcpyAsync(out.ctypes.data, offsets.data.ptr, offsets.nbytes,
                                      _D2H, stream.ptr)
    elif offsets.size:
        n = offsets.size
        _build.kernel(ctx, _SRC, _NAMES, "offsets_to_mapped_kernel")(
            (1,), (min(_THREADS, 32 * -(-n // 32)),),
            (offsets, np.uint64(mapped), np.int32(n)))
    if event is None:
        event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    return event


def permute_fwd(ctx, x, order, top_k: int, xp) -> None:
    """x (T, D) bf16|f32 -> xp (R, D) same dtype: xp[r] = x[order[r] // k], an exact gather.
    As reference permute_fwd."""
    t, d = x.shape
    _build.check("x", x, (t, d))
    _check_index("order", order, (t * top_k,))
    _build.check("xp", xp, (t * top_k, d), (x.dtype,))
    row_bytes = d * x.dtype.itemsize
    if row_bytes % 16 == 0 and _build.aligned16(x, xp):
        unit, units = "uint4", row_bytes // 16
    else:
        unit, units = "unsigned short", row_bytes // 2
    n = t * top_k * units
    if n:
        _build.kernel(ctx, _SRC, _NAMES, f"permute_fwd_kernel<{unit}>")(
            (_build.flat_grid(ctx, n, _THREADS),), (_THREADS,),
            (x, order, xp, np.int64(t * top_k), np.int64(units), np.int32(top_k)))


def _vec(d: int, *arrays) -> int:
    return 8 if d % 8 == 0 and _build.aligned16(*arrays) else 1


def permute_bwd(ctx, dxp, inv, top_k: int, dx, residual=None) -> None:
    """dxp (R, D) bf16|f32 -> dx (T, D) bf16|f32 = (residual +) each token's k rows summed in
    fp32 in slot order, rounded once. As reference permute_bwd (fp32 out), and with residual
    (T, D) f32 = the router's dx, the block's `up(dx_router) + permute_bwd(dxp)` before its one
    rounding (bf16 out): bit-identical to the reference in both cases. inv from expert_order."""
    r, d = dxp.shape
    if r % top_k:
        raise ValueError(f"dxp has {r} rows, not a multiple of top_k {top_k}")
    t = r // top_k
    _build.check("dxp", dxp, (r, d))
    _check_index("inv", inv, (r,))
    _build.check("dx", dx, (t, d))
    if residual is not None:
        _build.check("residual", residual, (t, d), (F32,))
    v = _vec(d, dxp, dx, *(() if residual is None else (residual,)))
    name = (f"permute_bwd_kernel<{_build.ctype(dxp.dtype, 'dxp')}, "
            f"{_build.ctype(dx.dtype, 'dx')}, {v}, {'false' if residual is None else 'true'}>")
    n = t * d // v
    if n:
        _build.kernel(ctx, _SRC, _NAMES, name)(
            (_build.flat_grid(ctx, n, _THREADS),), (_THREADS,),
            (dxp, inv, dx if residual is None else residual, dx, np.int64(t), np.int32(d),
             np.int32(top_k)))


def unpermute_fwd(ctx, yp, inv, topk_weight, y) -> None:
    """yp (R, D) bf16|f32, topk_weight (T, k) f32 -> y (T, D) bf16|f32: y[t] = sum_j
    w[t, j] * yp[inv[t k + j]], fp32 products summed in slot order, rounded once to y's dtype.
    As reference unpermute_fwd, bit for bit: y in yp's dtype is the reference on yp; an fp32 y
    from bf16 yp is the reference on yp widened to fp32 (the unrounded sum the engine's combine
    adds onto the residual, dataflow.ops_cuda). inv from expert_order."""
    t, k = topk_weight.shape
    r, d = yp.shape
    _build.check("yp", yp, (t * k, d))
    _check_index("inv", inv, (r,))
    _build.check("topk_weight", topk_weight, (t, k), (F32,))
    _build.check("y", y, (t, d))
    v = _vec(d, yp, y)
    n = t * d // v
    if n:
        _build.kernel(ctx, _SRC, _NAMES,
                      f"unpermute_fwd_kernel<{_build.ctype(yp.dtype, 'yp')}, "
                      f"{_build.ctype(y.dtype, 'y')}, {v}>")(
            (_build.flat_grid(ctx, n, _THREADS),), (_THREADS,),
            (yp, inv, topk_weight, y, np.int64(t), np.int32(d), np.int32(k)))


def unpermute_bwd(ctx, dy, yp, order, topk_weight, dyp, d_topk_weight) -> None:
    """dy (T, D), yp (R, D) bf16|f32 (one dtype), topk_weight (T, k) f32 -> dyp (R, D) in dy's
    dtype, d_topk_weight (T, k) f32: dyp[r] = w[pair] * dy[token] (bits of the reference),
    d_w[pair] = <dy[token], yp[r]> (fp32, a block's tree sum). As reference unpermute_bwd; one
    block per routed row."""
    t, k = topk_weight.shape
    _, d = dy.shape
    _build.check("dy", dy, (t, d))
    _build.check("yp", yp, (t * k, d), (dy.dtype,))
    _check_index("order", order, (t * k,))
    _build.check("topk_weight", topk_weight, (t, k), (F32,))
    _build.check("dyp", dyp, (t * k, d), (dy.dtype,))
    _build.check("d_topk_weight", d_topk_weight, (t, k), (F32,))
    v = _vec(d, dy, yp, dyp)
    if t * k:
        _build.kernel(ctx, _SRC, _NAMES,
                      f"unpermute_bwd_kernel<{_build.ctype(dy.dtype, 'dy')}, {v}>")(
            (t * k,), (_THREADS,),
            (dy, yp, order, topk_weight, dyp, d_topk_weight, np.int32(d), np.int32(k)))


# ------------------------------------------------------------------------ expert GEMM loop

def _host_offsets(offsets, n_rows: int) -> list[int]:
    """The host offsets as Python ints, after checking they describe all n_rows rows."""
    if isinstance(offsets, cupy.ndarray):
        raise TypeError("offsets must be on the host (NumPy int64): copy them with "
                        "offsets_to_host and wait on its event; reading device offsets here "
                        "would be a hidden sync")
    off = np.asarray(offsets)
    if off.ndim != 1 or off.size < 2 or off.dtype != I64:
        raise ValueError(f"offsets must be (N + 1,) int64, got {off.dtype} {off.shape}")
    if off[0] != 0 or off[-1] != n_rows or np.any(np.diff(off) < 0):
        raise ValueError(f"offsets must rise from 0 to the {n_rows} routed rows; got "
                         f"{off[0]}..{off[-1]} (an expert index outside [0, N) in topk_idx "
                         f"leaves offsets[N] short)")
    return off.tolist()


def _expert_ptr(w, e: int, shape: tuple[int, int], what: str, dtypes) -> int:
    """Device pointer of expert e's matrix in a sequence of N matrices (None for an idle one)."""
    m = w[e]
    if m is None:
        raise ValueError(f"{what}[{e}] is None, but expert {e} has routed rows")
    _build.check(f"{what}[{e}]", m, shape, dtypes)
    return m.data.ptr


def _expert_ptrs(w, experts: list[int], shape: tuple[int, int], what: str, dtypes):
    """(pointers of the listed experts' matrices, their dtype) from a stacked (N, ...) array
    (checked once, then pointer arithmetic: indexing a CuPy array builds a view object, which
    costs more host time than a small GEMM takes on the GPU) or a sequence of N matrices of one
    dtype (each checked). A stacked array may step over more than one matrix per expert (the
    engine's views of a layer block, where an expert's three matrices lie together); each
    expert's matrix must be C-contiguous."""
    if isinstance(w, cupy.ndarray):
        if w.ndim != 3 or tuple(w.shape[1:]) != tuple(shape):
            raise ValueError(f"{what} has shape {tuple(w.shape)}; expected (N, {shape[0]}, "
                             f"{shape[1]})")
        if np.dtype(w.dtype) not in dtypes:
            raise TypeError(f"{what} has dtype {w.dtype}; this op takes "
                            f"{', '.join(str(d) for d in dtypes)}")
        isz = w.dtype.itemsize
        if (tuple(w.strides[1:]) != (shape[1] * isz, isz)
                or w.strides[0] < shape[0] * shape[1] * isz):
            raise ValueError(f"{what}: each expert's matrix must be C-contiguous and the "
                             f"experts apart (strides {w.strides})")
        return [w.data.ptr + e * w.strides[0] for e in experts], np.dtype(w.dtype)
    ptrs = [_expert_ptr(w, e, shape, what, dtypes) for e in experts]
    kinds = {np.dtype(w[e].dtype) for e in experts}
    if len(kinds) > 1:
        raise TypeError(f"{what}'s experts mix dtypes {sorted(map(str, kinds))}; give one dtype")
    return ptrs, (kinds.pop() if kinds else np.dtype(dtypes[0]))


def _check_n_experts(n_experts: int, **mats) -> None:
    for what, w in mats.items():
        if len(w) != n_experts:
            raise ValueError(f"{what} has {len(w)} experts; offsets describe {n_experts}")


def experts_fwd(ctx, xp, offsets, w_gate, w_up, w_down, yp, gate, up, *, h) -> None:
    """xp (R, D) bf16 rows grouped by expert, offsets (N + 1,) int64 ON THE HOST
    (offsets_to_host), w_gate, w_up (N, F, D) and w_down (N, D, F), each a stacked device array
    or a sequence of N matrices (None allowed for an expert with no rows) -> yp (R, D),
    gate (R, F), up (R, F) (what the backward needs), all in xp's dtype; h (R, F) is scratch
    (silu(gate) * up; must not alias gate or up).

    As reference experts_fwd: per expert with rows, gate = x @ Wg.T, up = x @ Wu.T (cuBLAS,
    fp32 accumulation, one rounding), then one swiglu launch over all R rows, then per expert
    y = h @ Wd.T. An expert with no rows launches nothing and reads none of its weights.
    """
    r, d = xp.shape
    dt = xp.dtype
    _build.check("xp", xp, (r, d))
    off = _host_offsets(offsets, r)
    n_experts = len(off) - 1
    _check_n_experts(n_experts, w_gate=w_gate, w_up=w_up, w_down=w_down)
    f = gate.shape[1] if gate.ndim == 2 else -1
    for what, a, shape in (("yp", yp, (r, d)), ("gate", gate, (r, f)), ("up", up, (r, f)),
                           ("h", h, (r, f))):
        _build.check(what, a, shape, (dt,))
    if h.data.ptr in (gate.data.ptr, up.data.ptr) and r:
        raise ValueError("h must not alias gate or up: the backward needs both")
    isz = dt.itemsize
    active = [(off[e], off[e + 1] - off[e]) for e in range(n_experts) if off[e + 1] > off[e]]
    experts = [e for e in range(n_experts) if off[e + 1] > off[e]]
    wg, _ = _expert_ptrs(w_gate, experts, (f, d), "w_gate", (dt,))
    wu, _ = _expert_ptrs(w_up, experts, (f, d), "w_up", (dt,))
    wd, _ = _expert_ptrs(w_down, experts, (d, f), "w_down", (dt,))
    mm = gemm_loop(ctx, dt, dt)
    x0, g0, u0, h0, y0 = (a.data.ptr for a in (xp, gate, up, h, yp))
    # gate and up of an expert in one call: x shared, the weights and outputs a stride apart
    sw, so = _stride(wg, wu, isz), _stride([g0], [u0], isz)
    pair = None if sw is None or so is None else (2, 0, sw, so)
    for (r0, n), pg, pu in zip(active, wg, wu):
        xs = x0 + r0 * d * isz
        mm(n, f, d, xs, d, False, pg, d, True, g0 + r0 * f * isz, f, False, pair)
        if pair is None:
            mm(n, f, d, xs, d, False, pu, d, True, u0 + r0 * f * isz, f, False)
    swiglu_fwd(ctx, gate, up, h)
    for (r0, n), pd in zip(active, wd):
        mm(n, d, f, h0 + r0 * f * isz, f, False, pd, f, True, y0 + r0 * d * isz, d, False)


def _stride(first, second, itemsize: int):
    """The distance, in elements, from each pointer of `first` to the same expert's in `second`
    when it is one positive whole number of elements for all of them, else None: two GEMMs of
    one shape then run as one strided-batched call (cuBLASLt: the second product at the first's
    pointers plus the strides)."""
    dist = {q - p for p, q in zip(first, second)}
    if len(dist) != 1:
        return None
    step = dist.pop()
    return step // itemsize if step > 0 and step % itemsize == 0 else None


def experts_bwd_acc_elems(offsets, model_dim: int) -> int:
    """fp32 elements experts_bwd's dx_acc needs: the largest expert's rows x D (host offsets)."""
    off = np.asarray(offsets)
    return int(np.max(np.diff(off), initial=0)) * model_dim


def experts_bwd(ctx, xp, offsets, w_gate, w_up, w_down, gate, up, dyp, dxp, dw_gate, dw_up, dw_down,
                *, dgate, dup, h, dx_acc=None, accumulate: bool = True) -> None:
    """xp (R, D), gate and up (R, F) from experts_fwd, dyp (R, D), all bf16; offsets (N + 1,)
    int64 on the host (the forward's) -> dxp (R, D) bf16; dw_gate, dw_up (N, F, D) and dw_down
    (N, D, F) f32|bf16, stacked or sequences, += the gradients (= when not accumulate), as
    linear_bwd_w accumulates weight grads (beta = 1, fp32 inside the GEMM).

    As reference experts_bwd: per expert dh = dy @ Wd; one swiglu_bwd launch over all rows gives
    dgate, dup and h = silu(gate) * up (recomputed); per expert dWd += dy.T @ h, dWg += dgate.T @
    x, dWu += dup.T @ x, and dx = dgate @ Wg + dup @ Wu summed in fp32 in dx_acc, rounded once.
    An expert with no rows launches nothing and leaves its grads untouched (the reference's
    zeros, added). Scratch: dgate (R, F) (holds dh first; must not alias gate or up), dup (R, F)
    (may alias up, which is then lost), h (R, F) (aliases nothing), dx_acc fp32 with at least
    experts_bwd_acc_elems(offsets, D) elements (allocated for this call when None).
    """
    r, d = xp.shape
    dt = xp.dtype
    _build.check("xp", xp, (r, d))
    off = _host_offsets(offsets, r)
    n_experts = len(off) - 1
    _check_n_experts(n_experts, w_gate=w_gate, w_up=w_up, w_down=w_down, dw_gate=dw_gate,
                     dw_up=dw_up, dw_down=dw_down)
    f = gate.shape[1] if gate.ndim == 2 else -1
    for what, a, shape in (("gate", gate, (r, f)), ("up", up, (r, f)), ("dyp", dyp, (r, d)),
                           ("dxp", dxp, (r, d)), ("dgate", dgate, (r, f)),
                           ("dup", dup, (r, f)), ("h", h, (r, f))):
        _build.check(what, a, shape, (dt,))
    if r and (dgate.data.ptr in (gate.data.ptr, up.data.ptr)
              or h.data.ptr in (gate.data.ptr, up.data.ptr, dgate.data.ptr, dup.data.ptr)
              or dup.data.ptr == gate.data.ptr):
        raise ValueError("experts_bwd scratch aliases an input: dgate must not alias gate or "
                         "up, dup not gate, h nothing")
    need = experts_bwd_acc_elems(off, d)
    if dx_acc is None:
        dx_acc = cupy.empty(need, dtype=F32)
    _build.check("dx_acc", dx_acc, None, (F32,))
    if dx_acc.size < need:
        raise ValueError(f"dx_acc holds {dx_acc.size} fp32 values; the largest expert needs "
                         f"{need} (experts_bwd_acc_elems)")
    acc_flat = dx_acc.reshape(-1)
    isz = dt.itemsize
    gdt = (BF16, F32)
    active = [(off[e], off[e + 1] - off[e]) for e in range(n_experts) if off[e + 1] > off[e]]
    experts = [e for e in range(n_experts) if off[e + 1] > off[e]]
    wg, _ = _expert_ptrs(w_gate, experts, (f, d), "w_gate", (dt,))
    wu, _ = _expert_ptrs(w_up, experts, (f, d), "w_up", (dt,))
    wd, _ = _expert_ptrs(w_down, experts, (d, f), "w_down", (dt,))
    dwg, tg = _expert_ptrs(dw_gate, experts, (f, d), "dw_gate", gdt)
    dwu, tu = _expert_ptrs(dw_up, experts, (f, d), "dw_up", gdt)
    dwd, tdd = _expert_ptrs(dw_down, experts, (d, f), "dw_down", gdt)
    mm, mm_acc = gemm_loop(ctx, dt, dt), gemm_loop(ctx, dt, F32)
    mm_dw = {t: gemm_loop(ctx, dt, t) for t in {tg, tu, tdd}}
    x0, dy0, dg0, du0, h0, a0 = (a.data.ptr for a in (xp, dyp, dgate, dup, h, acc_flat))
    # dW_gate and dW_up of an expert in one call where the gradients' and dgate/dup's distances
    # allow it (the engine's layer block: each expert's gate and up gradients together)
    sg, sd = _stride(dwg, dwu, np.dtype(tg).itemsize), _stride([dg0], [du0], isz)
    dpair = None if tg != tu or sg is None or sd is None else (2, sd, 0, sg)
    for (r0, n), pd in zip(active, wd):  # dh (n, F) = dy (n, D) @ Wd (D, F), into dgate
        mm(n, f, d, dy0 + r0 * d * isz, d, False, pd, f, False, dg0 + r0 * f * isz, f, False)
    swiglu_bwd(ctx, gate, up, dgate, dgate, dup, out=h)  # dgate reads dh then overwrites it
    # The input gradient of consecutive experts (their rows are consecutive) gathers in dx_acc
    # until it is full, then one cast rounds the batch: the same bits as a cast per expert, with
    # a few launches a layer instead of one per expert.
    first = 0  # the first row of the batch in dx_acc
    for (r0, n), pg, pu, pd, gg, gu, gd in zip(active, wg, wu, wd, dwg, dwu, dwd):
        if (r0 + n - first) * d > acc_flat.size:
            cast(ctx, acc_flat[:(r0 - first) * d], dxp[first:r0])
            first = r0
        xs, dys = x0 + r0 * d * isz, dy0 + r0 * d * isz
        hs, dgs, dus = h0 + r0 * f * isz, dg0 + r0 * f * isz, du0 + r0 * f * isz
        mm_dw[tdd](d, f, n, dys, d, True, hs, f, False, gd, f, accumulate)
        mm_dw[tg](f, d, n, dgs, f, True, xs, d, False, gg, d, accumulate, dpair)
        if dpair is None:
            mm_dw[tu](f, d, n, dus, f, True, xs, d, False, gu, d, accumulate)
        acc = a0 + (r0 - first) * d * 4
        mm_acc(n, d, f, dgs, f, False, pg, d, False, acc, d, False)
        mm_acc(n, d, f, dus, f, False, pu, d, False, acc, d, True)
    if active:
        end = active[-1][0] + active[-1][1]
        cast(ctx, acc_flat[:(end - first) * d], dxp[first:end])
