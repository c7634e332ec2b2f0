"""The op table for the NumPy backend: every op writes into buffers the caller passes (views of
the arenas), with the same signatures and semantics the CUDA op table implements. Each op wraps
the reference kernel of the same name, so the NumPy backend computes exactly the definitions of
truth. Never allocates arena memory; temporaries are NumPy scratch."""

from __future__ import annotations

import numpy as np

import dataflow.kernels.reference as ref
from dataflow import norm_parts
from dataflow.kernels.reference import moe_experts as ref_experts
from dataflow.kernels.reference import moe_router as ref_router
from dataflow.kernels.reference import head_vocab as ref_vocab
from dataflow.kernels.reference import lora as ref_lora
from dataflow.kernels.reference import fp8_base as ref_fp8_base

F32 = np.float32


def _store(dst: np.ndarray, value, accumulate: bool) -> None:
    """dst (=|+=) value, summing in fp32 and rounding once to dst's dtype."""
    if accumulate:
        dst[...] = (dst.astype(F32) + value.astype(F32, copy=False)).astype(dst.dtype)
    else:
        dst[...] = value


def rms_norm_fwd(x, w, eps, y, rstd, copy=None):
    """`copy`: also gets x (taken before y is written: y may alias x)."""
    if copy is not None:
        copy[...] = x
    y[...], rstd[...] = ref.rms_norm_fwd(x, w, eps)


def rms_norm_bwd(x, w, rstd, dy, dx, dw, residual=None):
    """dw accumulates (+=); None forms none (a frozen block). `residual`: dx then gets it
    added, as add_(dx, residual) would."""
    dx_, dw_ = ref.rms_norm_bwd(x, w, rstd, dy)
    dx[...] = dx_
    if residual is not None:
        _store(dx, residual, True)
    if dw is not None:
        _store(dw, dw_, True)


def linear_fwd(x, w, y, accumulate=False, alpha=1.0):
    """y (=|+=) alpha * (x @ w.T); with accumulate the sum is formed in fp32 (cuBLAS beta=1).
    alpha (cuBLAS's alpha; LoRA's s = alpha / r) multiplies the fp32 product before the one
    rounding to y's dtype; alpha 1 is the path without it, bit for bit."""
    if alpha != 1.0:
        _store(y, (x.astype(F32) @ w.astype(F32).T) * F32(alpha), accumulate)
    elif accumulate:
        _store(y, x.astype(F32) @ w.astype(F32).T, True)
    else:
        y[...] = ref.linear_fwd(x, w)


def bias_fill(b, y):
    """y (T, O) = b (O,) on every row: a biased projection starts from its bias, then
    linear_fwd accumulates x @ w.T onto it (one rounding of b + x @ w.T, as ref.linear_fwd)."""
    y[...] = b


def bias_bwd(dy, db):
    """db (O,) += sum over the rows of dy (T, O), summed in fp32 and rounded once."""
    _store(db, ref.bias_bwd(dy), True)


def linear_bwd_x(dy, w, dx, accumulate=False, alpha=1.0):
    """dx (=|+=) alpha * (dy @ w), the fp32 product scaled before the one rounding (as
    linear_fwd's alpha)."""
    p = dy.astype(F32) @ w.astype(F32)
    _store(dx, p * F32(alpha) if alpha != 1.0 else p, accumulate)


def linear_bwd_w(dy, x, dw, accumulate=True):
    _store(dw, dy.astype(F32).T @ x.astype(F32), accumulate)


def rope_fwd(x, positions, inv_freq, out):
    """inv_freq (E/2,) float64: the config's table (dataflow.rope.rope_table)."""
    out[...] = ref.rope_fwd(x, positions, inv_freq)


def rope_bwd(dy, positions, inv_freq, out):
    out[...] = ref.rope_bwd(dy, positions, inv_freq)


def swiglu_fwd(gate, up, out):
    out[...] = ref.swiglu_fwd(gate, up)


def swiglu_bwd(gate, up, dh, dgate, dup, out=None):
    """With `out`: also the forward's silu(gate) * up into it (the backward that needs it)."""
    h = None if out is None else ref.swiglu_fwd(gate, up)
    dgate[...], dup[...] = ref.swiglu_bwd(gate, up, dh)
    if out is not None:
        out[...] = h


def embedding_fwd(ids, table, out):
    out[...] = ref.embedding_fwd(ids, table)


def embedding_bwd(ids, dx, dtable):
    """dtable accumulates (+=), in fp32 per touched row, rounded once per row."""
    ids = np.asarray(ids)
    rows, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((rows.size, dx.shape[1]), dtype=F32)
    np.add.at(sums, inverse, dx.astype(F32))
    dtable[rows] = (dtable[rows].astype(F32) + sums).astype(dtable.dtype)


def attention_fwd(q, k, v, q_offset, o, lse):
    o[...], lse[...] = ref.attention_fwd(q, k, v, q_offset)


def attention_bwd(q, k, v, o, lse, do, q_offset, dq, dk, dv):
    """dq is overwritten; dk and dv (fp32, whole context) accumulate (+=)."""
    dq_, dk_, dv_ = ref.attention_bwd(q, k, v, o, lse, do, q_offset)
    dq[...] = dq_
    dk += dk_.astype(dk.dtype)
    dv += dv_.astype(dv.dtype)


def attention_bwd_own(q, k, v, o, lse, do, dq, dk, dv):
    """A chunk against its own keys (no context): dq, dk and dv overwritten, dk and dv in
    k's dtype, the values attention_bwd would accumulate from zero in fp32 and then round."""
    dq_, dk_, dv_ = ref.attention_bwd(q, k, v, o, lse, do, 0)
    dq[...] = dq_
    dk[...] = dk_.astype(F32).astype(dk.dtype)
    dv[...] = dv_.astype(F32).astype(dv.dtype)


def head_loss_fwd_bwd(x, w, targets, logits, grad_scale, dx, dw, loss_acc):
    """Sub-chunks of logits.shape[0] tokens; dw accumulates (None: not formed, a frozen head);
    loss_acc += [loss_sum, n_valid]."""
    loss, n, dx_, dw_ = ref.head_loss_fwd_bwd(x, w, targets, sub_tokens=logits.shape[0],
                                              grad_scale=grad_scale)
    dx[...] = dx_
    if dw is not None:
        _store(dw, dw_, True)
    loss_acc[0] += F32(loss)
    loss_acc[1] += F32(n)


def vocab_stats(x, w, targets, row0, logits, stats):
    """A vocabulary shard's per-token statistics (T, 3) of x (T, D) against its rows w (Vs, D)
    from global row row0 (head_vocab.shard_stats, logits.shape[0] tokens at a time)."""
    stats[...] = ref_vocab.shard_stats(x, w, targets, row0, sub_tokens=logits.shape[0])


def vocab_merge(stats, other):
    """stats (T, 3) = the merge of stats and other (head_vocab.merge_stats, stats first)."""
    stats[...] = ref_vocab.merge_stats(stats, other)


def vocab_loss(stats, targets, loss_acc):
    """loss_acc += [loss_sum, n_valid] of the merged statistics (head_vocab.stats_loss)."""
    _, loss, n = ref_vocab.stats_loss(stats, targets)
    loss_acc[0] += F32(loss)
    loss_acc[1] += F32(n)


def vocab_grad(x, w, targets, row0, stats, logits, grad_scale, dx, dw):
    """A vocabulary shard's fp32 partial dx (overwritten) and its rows' dw (+=) from the merged
    statistics (head_vocab.shard_bwd)."""
    lse = stats[:, 0] + np.log(stats[:, 1])
    dx_, dw_ = ref_vocab.shard_bwd(x, w, targets, row0, lse, sub_tokens=logits.shape[0],
                                   grad_scale=grad_scale)
    dx[...] = dx_
    _store(dw, dw_, True)


def adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    """grad_scale is a float or a 0-d/1-element fp32 array (device scalar for clipping)."""
    ref.adamw_step(param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, grad_scale=float(np.asarray(grad_scale).ravel()[0]))


def add_(dst, src):
    _store(dst, src, True)


def cast(src, dst):
    dst[...] = src.astype(dst.dtype)


def scale_(x, s):
    """x *= s in place (fp32 product, one rounding): kernels.reference.lora.scale."""
    x[...] = ref_lora.scale(x, s)


def fp8_base_dequant(codes, scales, out):
    """out (O, I) bf16 = codes (O, I) E4M3 bits (uint8) * scales (O,) fp32 of their row: the
    fp8-stored frozen base's copy the next base GEMM reads (docs/lora.md)."""
    out[...] = ref_fp8_base.fp8_base_dequant(codes, scales)


def zero_rows_where_(ids, x, value):
    """Zero the rows of x (T, D) whose token id is `value` (the others untouched): an
    embedding's padding row gets no gradient from its lookup."""
    x[np.asarray(ids).reshape(-1) == value] = 0


def fill_(x, value):
    x[...] = value


def clip_scale(sumsq_value, max_norm, out, scale=1.0):
    """out[0] = scale * min(1, max_norm / (sqrt(sumsq_value[0]) + 1e-6)) in fp32, as the CUDA
    kernel computes it (an infinite max_norm gives exactly `scale`)."""
    norm = np.sqrt(F32(sumsq_value[0]))
    out[0] = F32(scale) * min(F32(1.0), F32(max_norm) / (norm + F32(1e-6)))


def sumsq(x, out, accumulate=True):
    """out[0] (=|+=) sum(x^2) in fp32: each 1,024-element sub-block's float64 sum, the sums
    added exactly and rounded to float64 once, then to fp32 (dataflow.norm_parts: the bits a
    split update's replicas get from their parts, whatever their number)."""
    s = norm_parts.block_sumsq(x)
    out[0] = out[0] + F32(s) if accumulate else F32(s)


def sumsq_blocks(x, out):
    """out (ceil(x.size / 1024),) f64 = each 1,024-element sub-block's float64 sum of squares
    (dataflow.norm_parts.sub_block_sums), the CUDA kernel's truth up to float64 rounding."""
    out[...] = norm_parts.sub_block_sums(x)


# -- mixture of experts (kernels.reference.moe_router / moe_experts; docs/moe.md) -------------
# Index arrays and counts are int64 arena views (dataflow.memplan.plan.buffers.moe_saved_specs), the
# reference's dtype and the CUDA kernels'.


def moe_route(x, w_router, top_k, norm_topk_prob, logits, probs, topk_idx, topk_weight, order,
              offsets):
    """x (T, D), w_router (N, D) -> logits, probs (T, N) fp32, topk_idx (T, k) int64,
    topk_weight (T, k) fp32 (router_fwd), order (R,) and offsets (N + 1,) int64
    (expert_order): the routing of one chunk, the same bits whenever it is re-run."""
    lg, p, idx, wt = ref_router.router_fwd(x, w_router, top_k, norm_topk_prob=norm_topk_prob)
    o, off = ref_experts.expert_order(idx, w_router.shape[0])
    logits[...], probs[...], topk_idx[...], topk_weight[...] = lg, p, idx, wt
    order[...], offsets[...] = o, off


def moe_route_stats(logits, probs, topk_idx, counts, sums):
    """counts (N,) int64 += the chunk's (token, slot) pairs per expert; sums (N + 1,) fp32:
    [:N] += the softmax summed over tokens, [N] += sum of logsumexp(logits)^2 (the round's
    load-balancing and z-loss totals, load_balancing_stats / router_z_loss)."""
    c, prob_sum = ref_router.load_balancing_stats(probs, topk_idx)
    lse_sq, _ = ref_router.router_z_loss(logits, 1)
    counts += c.astype(counts.dtype)
    sums[:-1] += prob_sum.astype(F32)
    sums[-1] += F32(lse_sq)


def moe_round_losses(counts, sums, n_rows, out):
    """out (2,) fp32 = (load-balancing loss, z-loss) of a round's totals over n_rows rows
    (tokens x MoE layers), unscaled by their coefficients."""
    out[0] = ref_router.load_balancing_loss(counts.astype(np.int64), sums[:-1], n_rows)
    out[1] = float(sums[-1]) / n_rows


def moe_totals_add(counts, sums, partial_counts, partial_sums):
    """A ring rank's routing totals += the previous ranks' (int64 counts exactly, the fp32 sums
    with one fp32 addition each)."""
    np.add(counts, partial_counts, out=counts)
    np.add(sums, partial_sums, out=sums)


def moe_permute(x, order, top_k, xp):
    """xp (R, D) = x[order // top_k]: each routed row's token (permute_fwd, a gather)."""
    xp[...] = ref_experts.permute_fwd(x, order, top_k)


def moe_experts_fwd(xp, offsets, w_gate, w_up, w_down, gate, up, act, yp):
    """xp (R, D) grouped by offsets; w_gate, w_up (N, F, D), w_down (N, D, F) stacked views of
    the layer block -> gate, up, act (R, F), yp (R, D) (experts_fwd; act = silu(gate) * up,
    the down projection's input). An expert with no rows reads none of its weights."""
    yp_, gate_, up_ = ref_experts.experts_fwd(xp, offsets, w_gate, w_up, w_down)
    gate[...], up[...], yp[...] = gate_, up_, yp_
    act[...] = ref.swiglu_fwd(gate_, up_)


def moe_combine(yp, order, topk_weight, out):
    """out (T, D) += sum_j topk_weight[t, j] * yp[row of (t, j)], the k terms and out summed
    in fp32 in slot order and rounded once (unpermute_fwd fused with the residual add, as the
    dense FFN's down projection accumulates onto the residual)."""
    y = ref_experts.unpermute_fwd(yp.astype(F32), order, topk_weight)  # fp32: not rounded
    out[...] = (out.astype(F32) + y).astype(out.dtype)


def moe_combine_bwd(dy, yp, order, topk_weight, dyp, d_topk_weight):
    """dy (T, D) -> dyp (R, D) = weight * dy[token], d_topk_weight (T, k) fp32 =
    <dy[token], yp[row]> (unpermute_bwd)."""
    dyp[...], d_topk_weight[...] = ref_experts.unpermute_bwd(dy, yp, order, topk_weight)


def moe_experts_bwd(xp, offsets, w_gate, w_up, w_down, gate, up, dyp, dxp, dw_gate, dw_up,
                    dw_down):
    """dyp (R, D) -> dxp (R, D); the stacked weight gradients accumulate (+=, fp32 sums
    rounded once to their dtype; an expert with no rows adds exact zeros) (experts_bwd)."""
    dxp_, dg, du, dd = ref_experts.experts_bwd(xp, offsets, w_gate, w_up, w_down, gate, up, dyp)
    dxp[...] = dxp_
    for dst, value in ((dw_gate, dg), (dw_up, du), (dw_down, dd)):
        _store(dst, value, True)


def moe_router_bwd(x, w_router, logits, probs, topk_idx, d_topk_weight, norm_topk_prob, counts,
                   aux_coef, z_coef, n_rows, dxp, order, dx, dw_router):
    """The router's backward and the block's input gradient: d_logits from the k selected
    weights (router_logits_bwd), plus aux_coef x the load-balancing loss's gradient over the
    round's `counts` and z_coef x the z-loss's, both averaged over n_rows; then dx (T, D) =
    d_logits @ w_router + the permuted rows' gradients summed per token (permute_bwd), in
    fp32, rounded once; dw_router (N, D) accumulates (+=). As moe_block_bwd."""
    d_logits = ref_router.router_logits_bwd(probs, topk_idx, d_topk_weight,
                                            norm_topk_prob=norm_topk_prob)
    if aux_coef:
        d_logits = d_logits + ref_router.load_balancing_loss_bwd(
            probs, counts.astype(np.int64), n_rows, aux_coef)
    if z_coef:
        _, lse = ref_router.router_z_loss(logits, 1)
        d_logits = d_logits + ref_router.router_z_loss_bwd(logits, lse, n_rows, z_coef)
    dx_router, dw = ref_router.router_bwd(x, w_router, d_logits)
    top_k = topk_idx.shape[1]
    dx[...] = (dx_router + ref_experts.permute_bwd(dxp, order, top_k)).astype(dx.dtype)
    _store(dw_router, dw, True)


WRITES: dict[str, tuple[int, ...]] = {
    "rms_norm_fwd": (3, 4, 5), "rms_norm_bwd": (4, 5), "linear_fwd": (2,), "linear_bwd_x": (2,),
    "linear_bwd_w": (2,), "bias_fill": (1,), "bias_bwd": (1,), "rope_fwd": (3,),
    "rope_bwd": (3,), "swiglu_fwd": (2,),
    "swiglu_bwd": (3, 4, 5), "embedding_fwd": (2,), "embedding_bwd": (2,),
    "attention_fwd": (4, 5), "attention_bwd": (7, 8, 9),
    "attention_bwd_own": (6, 7, 8), "head_loss_fwd_bwd": (3, 5, 6, 7),
    "adamw_step": (0, 2, 3), "add_": (0,), "cast": (1,), "fill_": (0,), "sumsq": (1,),
    "sumsq_blocks": (1,),
    "zero_rows_where_": (1,), "scale_": (0,),
    "fp8_base_dequant": (2,), "clip_scale": (2,),
    "moe_route": (4, 5, 6, 7, 8, 9), "moe_route_stats": (3, 4), "moe_round_losses": (3,),
    "moe_totals_add": (0, 1),
    "vocab_stats": (4, 5), "vocab_merge": (0,), "vocab_loss": (2,), "vocab_grad": (5, 7, 8),
    "moe_permute": (3,), "moe_experts_fwd": (5, 6, 7, 8), "moe_combine": (3,),
    "moe_combine_bwd": (4, 5), "moe_experts_bwd": (8, 9, 10, 11), "moe_router_bwd": (13, 14),
}
"""Positions of the arguments each op writes (accumulated outputs count as writes)."""
