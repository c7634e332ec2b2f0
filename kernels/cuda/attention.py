"""Causal grouped-query attention that can continue a sequence across chunks, forward and
backward, through cuDNN's fused SDPA (nvidia-cudnn-frontend, integer device pointers, so torch
never loads); matches dataflow.kernels.reference.attention. A simple fp32 RawKernel version
(kernels/cuda/attention.cu) serves any case cuDNN refuses and cross-checks it in the tests.

How the offset chunk is expressed: query i sits at absolute position q_offset + i and attends
to keys j <= q_offset + i. Keys past q_offset + T are seen by no query, so the graph is built on
the key prefix S' = q_offset + T (a contiguous prefix of k, v: no copy) with cuDNN's causal
mask aligned BOTTOM_RIGHT (key j visible to query i iff j <= i + S' - T = i + q_offset); with
q_offset = 0 that is the ordinary TOP_LEFT causal mask, which is used then. One graph per
shape (T, S', H, K, E, mask, determinism) per device, built on first use and cached with its
workspace (or pass `workspace`); a built graph is also serialised to disk and a later process
deserialises it instead of building (dataflow.kernels.cuda.graph_cache; a context made with
cudnn_cache_dir "off", DATAFLOW_CUDNN_CACHE_DIR=off for the CuPy backend, turns that off); the cuDNN
handle is one per device, bound to the current CuPy stream before each execute. Handles, graphs, and
the record of what cuDNN refused live in the CudaContext every op takes (kernels/cuda/context.py:
graph_sources, fallbacks, forget_graphs). Never synchronises by itself.

`quiesce` (every public op takes it): the cuDNN frontend holds the GIL through its C++ calls,
and creating the handle, building a graph and a graph's first execute (whose kernels CUDA loads
lazily) may synchronise the context. A Python function queued with cudaLaunchHostFunc needs the
GIL to finish, so such a call deadlocks against it (measured on the H100: 25 s and no return).
A caller that queues Python host functions passes a `quiesce()` that waits, GIL released, until
none is pending (dataflow's CuPy backend: its HOST stream's synchronize); it is called before
each of those first-time calls only, never in the steady state.

dk, dv are OVERWRITTEN for the whole context (rows q_offset + T .. S-1 get zeros) in bf16 on the
cuDNN path. To accumulate over the chunks of a split sequence into fp32 context buffers, call
utils.add_(dk_ctx_f32, dk) after each chunk.
"""

from __future__ import annotations

import logging
import math

import cupy
import numpy as np

from dataflow.kernels.cuda import _build, graph_cache, utils
from dataflow.kernels.cuda._build import BF16, F32

log = logging.getLogger(__name__)

_SRC = "attention.cu"
_TYPES = ("bf16", "float")
_EPLS = (1, 2, 4, 8)
_NAMES = tuple(
    [f"attn_simple_fwd<{t}, {e}>" for t in _TYPES for e in _EPLS]
    + [f"attn_simple_bwd_q<{t}, {e}>" for t in _TYPES for e in _EPLS]
    + [f"attn_simple_bwd_kv<{t}, {g}, {e}>" for t in _TYPES for g in _TYPES for e in _EPLS]
)

_UID_Q, _UID_K, _UID_V, _UID_O, _UID_STATS, _UID_DO, _UID_DQ, _UID_DK, _UID_DV = range(1, 10)


def _check(q, k, v, q_offset: int, causal: bool = True):
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"attention takes q (T, H, E), k and v (S, K, E); got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    t, h, e = q.shape
    s, kh, ke = k.shape
    if ke != e or h % kh:
        raise ValueError(f"attention shapes q {q.shape}, k {k.shape} do not agree (E must match, "
                         f"H a multiple of K)")
    if not causal and q_offset != 0:
        raise ValueError(f"an unmasked key block takes q_offset 0; got {q_offset}")
    if causal and (q_offset < 0 or q_offset + t > s):
        raise ValueError(f"query chunk [{q_offset}, {q_offset + t}) lies outside the {s} keys; "
                         f"q_offset + T must be <= S")
    _build.check("q", q)
    _build.check("k", k, None, (q.dtype,))
    _build.check("v", v, None, (q.dtype,))
    return t, h, e, s, kh


# ---------------------------------------------------------------------------------------------
# cuDNN path
# ---------------------------------------------------------------------------------------------

def _cudnn():
    import cudnn  # nvidia-cudnn-frontend; imported on first use only
    return cudnn


def _handle(ctx):
    cudnn = _cudnn()
    dev = cupy.cuda.runtime.getDevice()
    h = ctx.cudnn_handles.get(dev)
    if h is None:
        h = ctx.cudnn_handles[dev] = cudnn.create_handle()
    cudnn.set_stream(handle=h, stream=cupy.cuda.get_current_stream().ptr)
    return h


def destroy_handles(ctx) -> None:
    """Destroy the cuDNN handles of the CudaContext `ctx` (its close(), after its graphs were
    dropped); a frontend without destroy_handle leaves them to the process's exit."""
    if not ctx.cudnn_handles:
        return
    destroy = getattr(_cudnn(), "destroy_handle", None)
    if destroy is not None:
        for dev, h in list(ctx.cudnn_handles.items()):
            with cupy.cuda.Device(dev):
                destroy(h)
    ctx.cudnn_handles.clear()


def _bhsd(n_rows: int, n_heads: int, e: int) -> tuple[list[int], list[int]]:
    """cuDNN dims/strides [B, H, S, E] of a row-major (S, H, E) buffer."""
    return [1, n_heads, n_rows, e], [n_rows * n_heads * e, e, n_heads * e, 1]


def _mask_kwargs(cudnn, mask: str, style: str) -> dict:
    """The mask ("top_left" or "bottom_right" causal, or "none") in the frontend's current
    spelling ("band": a right bound of 0 from the aligned diagonal) or its older one ("legacy":
    use_causal_mask[_bottom_right])."""
    if mask == "none":
        return {}
    bottom_right = mask == "bottom_right"
    if style == "legacy":
        return {"use_causal_mask_bottom_right": True} if bottom_right else {"use_causal_mask": True}
    da = cudnn.diagonal_alignment
    align = da.BOTTOM_RIGHT if bottom_right else da.TOP_LEFT
    return {"diagonal_alignment": align, "diagonal_band_right_bound": 0}


def _finish(cudnn, g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = int(g.get_workspace_size())
    # [graph, own workspace (allocated on first use without a caller's workspace), bytes]: the
    # engine passes a slice of its arena, so a full device budget need not leave room for it.
    return [g, None, ws]


def _build_fwd(ctx, t, s, h, kh, e, mask, style, finish=_finish):
    cudnn = _cudnn()
    bf, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(handle=_handle(ctx), io_data_type=bf, intermediate_data_type=f32,
                      compute_data_type=f32)
    qd, qs = _bhsd(t, h, e)
    kd, ks = _bhsd(s, kh, e)
    qt = g.tensor(name="q", dim=qd, stride=qs, data_type=bf, uid=_UID_Q)
    kt = g.tensor(name="k", dim=kd, stride=ks, data_type=bf, uid=_UID_K)
    vt = g.tensor(name="v", dim=kd, stride=ks, data_type=bf, uid=_UID_V)
    o, stats = g.sdpa(name="sdpa_fwd", q=qt, k=kt, v=vt, generate_stats=True,
                      attn_scale=1.0 / math.sqrt(e), **_mask_kwargs(cudnn, mask, style))
    o.set_uid(_UID_O).set_output(True).set_dim(qd).set_stride(qs).set_data_type(bf)
    stats.set_uid(_UID_STATS).set_output(True).set_dim([1, h, t, 1]) \
        .set_stride([h * t, t, 1, 1]).set_data_type(f32)
    return finish(cudnn, g)


def _build_bwd(ctx, t, s, h, kh, e, mask, deterministic, style, finish=_finish):
    cudnn = _cudnn()
    bf, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(handle=_handle(ctx), io_data_type=bf, intermediate_data_type=f32,
                      compute_data_type=f32)
    qd, qs = _bhsd(t, h, e)
    kd, ks = _bhsd(s, kh, e)
    qt = g.tensor(name="q", dim=qd, stride=qs, data_type=bf, uid=_UID_Q)
    kt = g.tensor(name="k", dim=kd, stride=ks, data_type=bf, uid=_UID_K)
    vt = g.tensor(name="v", dim=kd, stride=ks, data_type=bf, uid=_UID_V)
    ot = g.tensor(name="o", dim=qd, stride=qs, data_type=bf, uid=_UID_O)
    dot = g.tensor(name="dO", dim=qd, stride=qs, data_type=bf, uid=_UID_DO)
    st = g.tensor(name="stats", dim=[1, h, t, 1], stride=[h * t, t, 1, 1], data_type=f32,
                  uid=_UID_STATS)
    dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=qt, k=kt, v=vt, o=ot, dO=dot, stats=st,
                                 attn_scale=1.0 / math.sqrt(e),
                                 use_deterministic_algorithm=deterministic,
                                 **_mask_kwargs(cudnn, mask, style))
    dq.set_uid(_UID_DQ).set_output(True).set_dim(qd).set_stride(qs).set_data_type(bf)
    dk.set_uid(_UID_DK).set_output(True).set_dim(kd).set_stride(ks).set_data_type(bf)
    dv.set_uid(_UID_DV).set_output(True).set_dim(kd).set_stride(ks).set_data_type(bf)
    return finish(cudnn, g)


def _cache_key(key: tuple) -> tuple:
    """The on-disk key of a graph key: the shape without the device ordinal (graph_cache adds
    the device's name and capability, cuDNN's and the frontend's versions)."""
    return ("sdpa", 1) + tuple(key[1:])


def _load_cached(ctx, key: tuple):
    """[graph, None, workspace bytes] deserialised from dataflow.kernels.cuda.graph_cache, or None."""
    if graph_cache.cache_dir(ctx.cudnn_cache_dir) is None:
        return None
    cudnn = _cudnn()
    handle = _handle(ctx)
    g = graph_cache.load(_cache_key(key), cudnn.pygraph,
                         graph_cache.environment(cudnn, key[0]), ctx.cudnn_cache_dir, handle)
    return None if g is None else [g, None, int(g.get_workspace_size())]


def _store_cached(ctx, key: tuple, graph) -> None:
    root = ctx.cudnn_cache_dir
    if graph_cache.cache_dir(root) is not None:
        graph_cache.store(_cache_key(key), graph, graph_cache.environment(_cudnn(), key[0]),
                          root)


def _graph(ctx, kind: str, t, s_used, h, kh, e, q_offset, deterministic=True, causal=True,
           quiesce=None):
    """Cached (graph, workspace) for this shape, or None when cuDNN refuses it (reason kept).
    A build (and the handle's creation) may synchronise: quiesce() first (module docstring)."""
    mask = ("bottom_right" if q_offset > 0 else "top_left") if causal else "none"
    key = (cupy.cuda.runtime.getDevice(), kind, t, s_used, h, kh, e, mask, deterministic)
    hit = ctx.graphs.get(key)
    if hit is not None:
        return hit, key
    if key in ctx.refused:
        return None, key
    if quiesce is not None:
        quiesce()
    cached = _load_cached(ctx, key)
    if cached is not None:
        ctx.graphs[key] = cached
        ctx.graph_origins[key] = "cache"
        return cached, key
    reasons = []
    for style in ("band", "legacy"):
        try:
            if kind == "fwd":
                built = _build_fwd(ctx, t, s_used, h, kh, e, mask, style)
            else:
                built = _build_bwd(ctx, t, s_used, h, kh, e, mask, deterministic, style)
        except Exception as exc:  # cuDNN reports unsupported shapes through several error types
            reasons.append(f"[{style}] {type(exc).__name__}: {exc}")
            continue
        ctx.graphs[key] = built
        ctx.graph_origins[key] = "built"
        _store_cached(ctx, key, built[0])
        return built, key
    ctx.refused[key] = "; ".join(reasons)
    log.warning("cuDNN SDPA %s refused %s (%s); using the simple attention kernels",
                kind, key, ctx.refused[key])
    return None, key


def attention_workspace_bytes(ctx, kind: str, n_q: int, n_heads: int, n_kv_heads: int,
                              head_dim: int, q_offset: int = 0, deterministic: bool = True,
                              n_keys: int | None = None, quiesce=None) -> int:
    """Builds (and caches) the cuDNN graph of kind "fwd" or "bwd" for a chunk of n_q queries at
    q_offset and returns its workspace bytes; call it at set-up so no graph is built and no
    workspace allocated in the hot loop (the graph depends on n_q and q_offset, not on S).
    n_keys: the backward of a whole key block seen by every query (attention_bwd's
    causal=False) instead. 0 when cuDNN refuses the shape (the simple kernels need none)."""
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd'; got {kind!r}")
    if n_keys is not None:
        built, _ = _graph(ctx, kind, n_q, n_keys, n_heads, n_kv_heads, head_dim, 0, deterministic,
                          causal=False, quiesce=quiesce)
    else:
        built, _ = _graph(ctx, kind, n_q, q_offset + n_q, n_heads, n_kv_heads, head_dim, q_offset,
                          deterministic, quiesce=quiesce)
    return 0 if built is None else built[2]


def _run(ctx, built, pack: dict, workspace, quiesce=None) -> None:
    g, ws, ws_bytes = built
    if workspace is not None and workspace.nbytes >= ws_bytes:
        ws = workspace
    elif ws is None:
        ws = built[1] = cupy.empty(max(ws_bytes, 16), dtype=np.uint8)
    first = id(g) not in ctx.executed
    if first and quiesce is not None:
        quiesce()  # the first execute loads the graph's kernels: it may synchronise
    g.execute(pack, ws.data.ptr, handle=_handle(ctx))
    if first:
        ctx.executed.add(id(g))


# ---------------------------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------------------------

def _epl(e: int) -> int:
    epl = -(-e // 32)
    for cand in _EPLS:
        if epl <= cand:
            return cand
    raise ValueError(f"head_dim {e} exceeds the simple attention kernels' limit of 256")


def attention_fwd(ctx, q, k, v, q_offset: int, o, lse, impl: str = "auto", workspace=None,
                  quiesce=None) -> None:
    """q (T, H, E), k, v (S, K, E) bf16 -> o (T, H, E) bf16, lse (H, T) f32 (written).

    Causal GQA: query i (absolute position q_offset + i) attends to keys j <= q_offset + i;
    scale 1/sqrt(E); lse = natural log-sum-exp of the scaled scores. impl: "auto" (cuDNN, the
    simple kernels where cuDNN refuses the shape), "cudnn" (raise instead), "simple".
    """
    t, h, e, s, kh = _check(q, k, v, q_offset)
    _build.check("o", o, (t, h, e), (q.dtype,))
    _build.check("lse", lse, (h, t), (F32,))
    if impl not in ("auto", "cudnn", "simple"):
        raise ValueError(f"impl must be 'auto', 'cudnn' or 'simple'; got {impl!r}")
    if impl != "simple" and q.dtype == BF16:
        built, key = _graph(ctx, "fwd", t, q_offset + t, h, kh, e, q_offset, quiesce=quiesce)
        if built is not None:
            _run(ctx, built, {_UID_Q: q.data.ptr, _UID_K: k.data.ptr, _UID_V: v.data.ptr,
                         _UID_O: o.data.ptr, _UID_STATS: lse.data.ptr}, workspace, quiesce)
            return
        if impl == "cudnn":
            raise RuntimeError(f"cuDNN SDPA refused {key}: {ctx.refused[key]}")
    elif impl == "cudnn":
        raise TypeError(f"the cuDNN path takes bf16 q, k, v; got {q.dtype}")
    name = f"attn_simple_fwd<{_build.ctype(q.dtype, 'q')}, {_epl(e)}>"
    if t:
        _build.kernel(ctx, _SRC, _NAMES, name)(
            (-(-t * h // 4),), (128,),
            (q, k, v, o, lse, np.int32(t), np.int32(s), np.int32(h), np.int32(kh), np.int32(e),
             np.int32(q_offset), np.float32(1.0 / math.sqrt(e))))


def attention_bwd(ctx, q, k, v, o, lse, do, q_offset: int, dq, dk, dv, impl: str = "auto",
                  deterministic: bool = True, workspace=None, causal: bool = True,
                  quiesce=None) -> None:
    """q, o, do (T, H, E), k, v (S, K, E) bf16, lse (H, T) f32 -> dq (T, H, E) bf16, dk, dv
    (S, K, E), all OVERWRITTEN: rows of dk, dv past q_offset + T (seen by no query) get zeros.

    cuDNN path: dk, dv bf16 (accumulate chunks with utils.add_ into fp32 buffers).
    deterministic=True (the default) asks cuDNN for its deterministic algorithm, so that reruns
    and placement-only plan changes stay bit-identical (DESIGN §5); False lets cuDNN accumulate
    dQ with atomics, measured 14 % faster on the H100 at 8b shapes. The simple kernels are always
    deterministic and also write fp32 dk, dv. impl as for attention_fwd.

    causal=False: every query sees every key of k (a block of keys wholly before the queries,
    q_offset must be 0, any number of keys); with o, lse and do of the whole attention this is
    that block's exact share of the gradient: dq is its part of the sum over key blocks, dk, dv
    are the block's. cuDNN only (the simple kernels are causal).
    """
    t, h, e, s, kh = _check(q, k, v, q_offset, causal)
    for what, a in (("o", o), ("do", do), ("dq", dq)):
        _build.check(what, a, (t, h, e), (q.dtype,))
    _build.check("lse", lse, (h, t), (F32,))
    _build.check("dk", dk, (s, kh, e))
    _build.check("dv", dv, (s, kh, e), (dk.dtype,))
    if impl not in ("auto", "cudnn", "simple"):
        raise ValueError(f"impl must be 'auto', 'cudnn' or 'simple'; got {impl!r}")
    if not causal and (impl == "simple" or q.dtype != BF16 or dk.dtype != BF16):
        raise ValueError("the unmasked (causal=False) backward runs on cuDNN only, in bf16")
    s_used = q_offset + t if causal else s
    if impl != "simple" and q.dtype == BF16 and dk.dtype == BF16:
        built, key = _graph(ctx, "bwd", t, s_used, h, kh, e, q_offset, deterministic, causal,
                            quiesce)
        if built is not None:
            _run(ctx, built, {_UID_Q: q.data.ptr, _UID_K: k.data.ptr, _UID_V: v.data.ptr,
                         _UID_O: o.data.ptr, _UID_STATS: lse.data.ptr, _UID_DO: do.data.ptr,
                         _UID_DQ: dq.data.ptr, _UID_DK: dk.data.ptr, _UID_DV: dv.data.ptr},
                 workspace, quiesce)
            if s_used < s:
                utils.fill_(ctx, dk[s_used:], 0.0)
                utils.fill_(ctx, dv[s_used:], 0.0)
            return
        if impl == "cudnn" or not causal:
            raise RuntimeError(f"cuDNN SDPA refused {key}: {ctx.refused[key]}")
    elif impl == "cudnn":
        raise TypeError(f"the cuDNN path takes bf16 q, k, v, dk, dv; got {q.dtype}, {dk.dtype}")
    tq, tg, epl = _build.ctype(q.dtype, "q"), _build.ctype(dk.dtype, "dk"), _epl(e)
    scalars = (np.int32(t), np.int32(s), np.int32(h), np.int32(kh), np.int32(e),
               np.int32(q_offset), np.float32(1.0 / math.sqrt(e)))
    if t:
        _build.kernel(ctx, _SRC, _NAMES, f"attn_simple_bwd_q<{tq}, {epl}>")(
            (-(-t * h // 4),), (128,), (q, k, v, o, lse, do, dq, *scalars))
    _build.kernel(ctx, _SRC, _NAMES, f"attn_simple_bwd_kv<{tq}, {tg}, {epl}>")(
        (-(-s * kh // 4),), (128,), (q, k, v, o, lse, do, dk, dv, *scalars))

