"""Router of the mixture-of-experts block on the GPU (kernels/cuda/moe_router.cu + cuBLAS):
logits, softmax, top-k with the reference's tie rule, the load-balancing statistics and loss,
the z-loss, and their backward; matches dataflow.kernels.reference.moe_router function by
function. Everything router-side is fp32 (logits are never rounded to bf16, docs/moe.md);
expert indices and counts are int64 as in the reference. Output buffers are passed in; all work
is enqueued on the current CuPy stream; nothing here synchronises with the host, and nothing
allocates except router_bwd when it is given no scratch.

Shape legend: kernels/__init__.py plus N routed experts (at most MAX_EXPERTS), k = top_k,
R = T * k routed rows. The losses are device scalars ((1,) fp32 arrays), not Python floats,
so reading them is the caller's (synchronising) choice."""

from __future__ import annotations

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32
from dataflow.kernels.cuda._cublas import gemm
from dataflow.kernels.cuda.linear import linear_fwd
from dataflow.kernels.cuda.utils import cast

_SRC = "moe_router.cu"
_NAMES = ("router_softmax_topk_kernel", "load_balancing_stats_kernel",
          "load_balancing_loss_kernel", "router_lse_kernel", "router_z_sum_kernel",
          "router_topk_bwd_kernel", "router_aux_bwd_kernel", "router_z_bwd_kernel")
I64 = np.dtype(np.int64)
MAX_EXPERTS = 256
"""Experts a row kernel holds in registers (32 lanes x MOE_PER_LANE in the .cu)."""
BWD_ROWS = 1024
"""Tokens whose x router_bwd widens to fp32 at a time (bounds its scratch)."""
_THREADS = 256
_WARPS = _THREADS // 32


def _rows_grid(n_tokens: int) -> tuple[int]:
    return (-(-n_tokens // _WARPS),)


def _check_probs(what: str, a, n_experts: int | None = None) -> tuple[int, int]:
    _build.check(what, a, None, (F32,))
    if a.ndim != 2:
        raise ValueError(f"{what} must be (T, N), got shape {a.shape}")
    t, n = a.shape
    if n_experts is not None and n != n_experts:
        raise ValueError(f"{what} has {n} experts; expected {n_experts}")
    if not 1 <= n <= MAX_EXPERTS:
        raise ValueError(f"{what} has {n} experts; the router kernels take 1..{MAX_EXPERTS} "
                         f"(raise MOE_PER_LANE in moe_router.cu for more)")
    return t, n


def _check_topk(top_k: int, n_experts: int) -> None:
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k {top_k} is outside 1..{n_experts} (the number of experts); "
                         f"pass num_experts_per_tok of the model's config")


def _check_scalar(what: str, a) -> None:
    _build.check(what, a, (1,), (F32,))


def router_softmax_topk(ctx, logits, top_k: int, probs, topk_idx, topk_weight, *,
                        norm_topk_prob: bool) -> None:
    """logits (T, N) f32 -> probs (T, N) f32, topk_idx (T, k) int64, topk_weight (T, k) f32.

    The part of reference router_fwd after its GEMM: probs = softmax(logits); topk_idx = the k
    largest per row, largest first, equal probabilities lower expert index first (router_topk);
    topk_weight = probs[topk_idx], divided by their sum when norm_topk_prob. One warp per token.
    """
    t, n = _check_probs("logits", logits)
    _check_topk(top_k, n)
    _build.check("probs", probs, (t, n), (F32,))
    _build.check("topk_idx", topk_idx, (t, top_k), (I64,))
    _build.check("topk_weight", topk_weight, (t, top_k), (F32,))
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "router_softmax_topk_kernel")(
            _rows_grid(t), (_THREADS,),
            (logits, probs, topk_idx, topk_weight, np.int32(t), np.int32(n), np.int32(top_k),
             np.int32(bool(norm_topk_prob))))


def router_fwd(ctx, x, w_router, top_k: int, logits, probs, topk_idx, topk_weight, *,
               norm_topk_prob: bool) -> None:
    """x (T, D) bf16, w_router (N, D) bf16 -> logits (T, N) f32 = x @ w_router.T (cuBLAS, fp32
    accumulation, fp32 output: never rounded to bf16), then router_softmax_topk. Mirrors
    reference router_fwd(x, w_router, top_k, norm_topk_prob=...) with its four outputs passed in.
    """
    _build.check("logits", logits, (x.shape[0], w_router.shape[0]), (F32,))
    linear_fwd(ctx, x, w_router, logits)
    router_softmax_topk(ctx, logits, top_k, probs, topk_idx, topk_weight,
                        norm_topk_prob=norm_topk_prob)


def router_logits_bwd(ctx, probs, topk_idx, d_topk_weight, d_logits, *, norm_topk_prob: bool,
                      accumulate: bool = False) -> None:
    """probs (T, N) f32, topk_idx (T, k) int64, d_topk_weight (T, k) f32 -> d_logits (T, N) f32
    (+= when accumulate). As reference router_logits_bwd: only the k selected probabilities carry
    gradient (dv = dw, or (dw - sum(dw * w)) / sum(v) with renormalisation), then the softmax's
    Jacobian spreads it over all N logits."""
    t, n = _check_probs("probs", probs)
    k = topk_idx.shape[1] if topk_idx.ndim == 2 else -1
    _check_topk(k, n)
    _build.check("topk_idx", topk_idx, (t, k), (I64,))
    _build.check("d_topk_weight", d_topk_weight, (t, k), (F32,))
    _build.check("d_logits", d_logits, (t, n), (F32,))
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "router_topk_bwd_kernel")(
            _rows_grid(t), (_THREADS,),
            (probs, topk_idx, d_topk_weight, d_logits, np.int32(t), np.int32(n), np.int32(k),
             np.int32(bool(norm_topk_prob)), np.int32(bool(accumulate))))


def router_bwd_scratch_elems(n_tokens: int, model_dim: int, n_experts: int) -> int:
    """fp32 elements router_bwd's scratch needs: w_router widened to fp32, plus up to BWD_ROWS
    rows of x widened to fp32."""
    return (n_experts + min(n_tokens, BWD_ROWS)) * model_dim


def router_bwd(ctx, x, w_router, d_logits, dx, dw_router, *, accumulate_dx: bool = False,
               accumulate_dw: bool = True, scratch=None) -> None:
    """x (T, D) bf16, w_router (N, D) bf16, d_logits (T, N) f32 -> dx (T, D) f32 = d_logits @
    w_router (+ dx when accumulate_dx), dw_router (N, D) f32 = d_logits.T @ x (+ dw_router when
    accumulate_dw, as linear_bwd_w accumulates weight grads). Mirrors reference router_bwd: both
    in fp32 (dx stays unrounded; the block adds the experts' dx before its one rounding).

    cuBLAS has no fp32 x bf16 GEMM, and rounding d_logits to bf16 would lose the fp32 the
    reference keeps, so w_router and x are widened to fp32 (exact) in `scratch` and the GEMMs
    run in fp32 (CUBLAS_COMPUTE_32F, no TF32): x in passes of BWD_ROWS tokens, so the scratch
    stays router_bwd_scratch_elems() fp32 values. With scratch None, one is allocated for this
    call (tests; the engine passes its own).
    """
    t, n = _check_probs("d_logits", d_logits)
    d = x.shape[1] if x.ndim == 2 else -1
    _build.check("x", x, (t, d), (BF16, F32))
    _build.check("w_router", w_router, (n, d), (BF16, F32))
    _build.check("dx", dx, (t, d), (F32,))
    _build.check("dw_router", dw_router, (n, d), (F32,))
    need = router_bwd_scratch_elems(t, d, n)
    if scratch is None:
        scratch = cupy.empty(need, dtype=F32)
    _build.check("scratch", scratch, None, (F32,))
    if scratch.size < need:
        raise ValueError(f"router_bwd scratch holds {scratch.size} fp32 values; it needs "
                         f"{need} (router_bwd_scratch_elems({t}, {d}, {n}))")
    flat = scratch.reshape(-1)
    w32 = flat[:n * d].reshape(n, d)
    cast(ctx, w_router, w32)
    # dx (T, D) = d_logits (T, N) @ w32 (N, D)
    gemm(ctx, t, d, n, d_logits.data.ptr, F32, n, False, w32.data.ptr, F32, d, False,
         dx.data.ptr, F32, d, accumulate_dx)
    if t == 0 and not accumulate_dw:
        dw_router.fill(0)  # no token: the reference's dw is zeros
    x32_all = flat[n * d:]
    for t0 in range(0, t, BWD_ROWS):
        rows = min(BWD_ROWS, t - t0)
        x32 = x32_all[:rows * d].reshape(rows, d)
        cast(ctx, x[t0:t0 + rows], x32)
        # dw_router (N, D) [+]= d_logits[t0:t1].T (N, rows) @ x32 (rows, D)
        gemm(ctx, n, d, rows, d_logits.data.ptr + t0 * n * 4, F32, n, True, x32.data.ptr, F32, d,
             False, dw_router.data.ptr, F32, d, accumulate_dw or t0 > 0)


def load_balancing_stats(ctx, probs, topk_idx, counts, prob_sum, *,
                         accumulate: bool = False) -> None:
    """probs (T, N) f32, topk_idx (T, k) int64 -> counts (N,) int64, prob_sum (N,) f32 (+= when
    accumulate: one accumulator per forward, summed over layers and chunks). As reference
    load_balancing_stats; prob_sum is summed in token order, so its bits equal the reference's
    on the same probs. One block per expert."""
    t, n = _check_probs("probs", probs)
    k = topk_idx.shape[1] if topk_idx.ndim == 2 else -1
    _build.check("topk_idx", topk_idx, (t, k), (I64,))
    _build.check("counts", counts, (n,), (I64,))
    _build.check("prob_sum", prob_sum, (n,), (F32,))
    _build.kernel(ctx, _SRC, _NAMES, "load_balancing_stats_kernel")(
        (n,), (_THREADS,),
        (probs, topk_idx, counts, prob_sum, np.int32(t), np.int32(n), np.int64(t * k),
         np.int32(bool(accumulate))))


def load_balancing_loss(ctx, counts, prob_sum, n_rows: int, loss, *,
                        accumulate: bool = False) -> None:
    """counts (N,) int64, prob_sum (N,) f32 summed over the forward -> loss (1,) f32 =
    N * sum_e (counts[e] / n_rows) * (prob_sum[e] / n_rows), summed in fp64 (+= when
    accumulate). As reference load_balancing_loss, which returns a Python float."""
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens x MoE layers), got {n_rows}")
    n = counts.shape[0] if counts.ndim == 1 else -1
    _build.check("counts", counts, (n,), (I64,))
    _build.check("prob_sum", prob_sum, (n,), (F32,))
    _check_scalar("loss", loss)
    _build.kernel(ctx, _SRC, _NAMES, "load_balancing_loss_kernel")(
        (1,), (32,), (counts, prob_sum, np.int32(n), np.float64(n_rows), loss,
                      np.int32(bool(accumulate))))


def load_balancing_loss_bwd(ctx, probs, counts, n_rows: int, coef: float, d_logits, *,
                            accumulate: bool = False) -> None:
    """probs (T, N) f32 of one layer and chunk, counts (N,) int64 summed over the whole forward
    -> d_logits (T, N) f32 (+= when accumulate) of coef * load_balancing_loss: d probs[t, e] =
    coef * N * counts[e] / n_rows^2 for every row, through the softmax. As reference
    load_balancing_loss_bwd (the scalar is formed in fp64 and rounded to fp32, as NumPy does)."""
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens x MoE layers), got {n_rows}")
    t, n = _check_probs("probs", probs)
    _build.check("counts", counts, (n,), (I64,))
    _build.check("d_logits", d_logits, (t, n), (F32,))
    c = np.float32(coef * n / float(n_rows) ** 2)
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "router_aux_bwd_kernel")(
            _rows_grid(t), (_THREADS,),
            (probs, counts, c, d_logits, np.int32(t), np.int32(n), np.int32(bool(accumulate))))


def router_z_loss(ctx, logits, n_rows: int, lse, loss, *, accumulate: bool = False) -> None:
    """logits (T, N) f32 -> lse (T,) f32 = logsumexp per row, loss (1,) f32 = sum_t lse_t^2 /
    n_rows (summed in fp64; += when accumulate). As reference router_z_loss (n_rows = 1 gives
    MoeStats.lse_sq_sum). Two launches: a warp per row, then one block for the sum."""
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens the mean runs over), got {n_rows}")
    t, n = _check_probs("logits", logits)
    _build.check("lse", lse, (t,), (F32,))
    _check_scalar("loss", loss)
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "router_lse_kernel")(
            _rows_grid(t), (_THREADS,), (logits, lse, np.int32(t), np.int32(n)))
    _build.kernel(ctx, _SRC, _NAMES, "router_z_sum_kernel")(
        (1,), (_THREADS,), (lse, np.int32(t), np.float64(n_rows), loss,
                            np.int32(bool(accumulate))))


def router_z_loss_bwd(ctx, logits, lse, n_rows: int, coef: float, d_logits, *,
                      accumulate: bool = False) -> None:
    """logits (T, N) f32, lse (T,) f32 from router_z_loss -> d_logits (T, N) f32 (+= when
    accumulate) of coef * z-loss: (2 coef / n_rows) * lse_t * softmax(logits)_t. As reference
    router_z_loss_bwd."""
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens the mean runs over), got {n_rows}")
    t, n = _check_probs("logits", logits)
    _build.check("lse", lse, (t,), (F32,))
    _build.check("d_logits", d_logits, (t, n), (F32,))
    c = np.float32(2.0 * coef / n_rows)
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "router_z_bwd_kernel")(
            _rows_grid(t), (_THREADS,),
            (logits, lse, c, d_logits, np.int32(t), np.int32(n), np.int32(bool(accumulate))))
