"""Token permutation to experts and back, and the routed experts' SwiGLU GEMMs over variable
token counts, forward and backward. Each expert is transformers' OlmoeMLP / Qwen3MoeMLP,
down(silu(gate(x)) * up(x)), with its own three matrices; the reference loops over experts and
skips those with no rows. Never decides routing (topk_idx arrives from moe_router) and never
allocates per-expert buffers: all experts share one (R, .) array sliced by offsets.

Layout (docs/moe.md): the R = T * k (token, slot) pairs, flattened as token * k + slot, are
sorted stably by expert. `order` (R,) lists them in that order, so expert e owns the rows
offsets[e]:offsets[e + 1] and, within them, tokens ascend. Shape legend: kernels/__init__.py
and moe_router (N experts, k per token, R routed rows); F is the expert ffn dim."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up
from dataflow.kernels.reference.linear import linear_bwd, linear_fwd
from dataflow.kernels.reference.swiglu import swiglu_bwd, swiglu_fwd


def expert_order(topk_idx: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """topk_idx (T, k) -> order (R,) int64, offsets (N + 1,) int64.

    order[r] = token * k + slot of the r-th routed row; offsets[e + 1] - offsets[e] is expert
    e's row count, zero allowed. int64 because R * D overflows 32 bits at long chunks.
    """
    flat = np.asarray(topk_idx).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_experts):
        raise ValueError(f"expert indices span {flat.min()}..{flat.max()}, outside "
                         f"0..{n_experts - 1}; pass the router's n_experts")
    order = np.argsort(flat, kind="stable").astype(np.int64)
    offsets = np.zeros(n_experts + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat, minlength=n_experts), out=offsets[1:])
    return order, offsets


def _inverse(order: np.ndarray) -> np.ndarray:
    """inv (R,) with inv[token * k + slot] = the row that pair occupies."""
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size, dtype=order.dtype)
    return inv


def permute_fwd(x: np.ndarray, order: np.ndarray, top_k: int) -> np.ndarray:
    """x (T, D) -> xp (R, D) in x's dtype: row r is x[order[r] // k] (a gather, exact)."""
    return x[order // top_k]


def permute_bwd(dxp: np.ndarray, order: np.ndarray, top_k: int) -> np.ndarray:
    """dxp (R, D) -> dx (T, D) in the acc dtype: the adjoint of the gather, each token's k rows
    summed. Written as a gather of the k rows and a sum in slot order, not an atomic scatter,
    so the result does not depend on the order rows are visited."""
    dt = acc_dtype(dxp)
    n_tokens = order.size // top_k
    rows = up(dxp, dt)[_inverse(order)]                    # (R, D) in (token, slot) order
    return rows.reshape(n_tokens, top_k, -1).sum(axis=1)


def unpermute_fwd(yp: np.ndarray, order: np.ndarray, topk_weight: np.ndarray) -> np.ndarray:
    """yp (R, D) expert outputs, topk_weight (T, k) -> y (T, D) in yp's dtype:
    y[t] = sum_j topk_weight[t, j] * yp[row of (t, j)], summed in the acc dtype in slot order,
    rounded once."""
    dt = acc_dtype(yp, topk_weight)
    n_tokens, top_k = topk_weight.shape
    rows = up(yp, dt)[_inverse(order)].reshape(n_tokens, top_k, -1)
    return np.sum(up(topk_weight, dt)[:, :, None] * rows, axis=1).astype(yp.dtype)


def unpermute_bwd(dy: np.ndarray, yp: np.ndarray, order: np.ndarray,
                  topk_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dy (T, D), yp (R, D), topk_weight (T, k) -> dyp (R, D) in dy's dtype, d_topk_weight
    (T, k) in the acc dtype: dyp[r] = w[pair] * dy[token], d_w[pair] = <dy[token], yp[r]>."""
    dt = acc_dtype(dy, yp, topk_weight)
    top_k = topk_weight.shape[1]
    dyf = up(dy, dt)[order // top_k]                       # (R, D)
    w_rows = up(topk_weight, dt).reshape(-1)[order]        # (R,)
    dyp = (w_rows[:, None] * dyf).astype(dy.dtype)
    d_w = np.empty(order.size, dtype=dt)
    d_w[order] = np.sum(dyf * up(yp, dt), axis=1)
    return dyp, d_w.reshape(topk_weight.shape)


def experts_fwd(xp: np.ndarray, offsets: np.ndarray, w_gate, w_up, w_down
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """xp (R, D) rows grouped by expert; w_gate, w_up (N, F, D) and w_down (N, D, F), each a
    stacked array or a sequence of N matrices -> yp (R, D), gate (R, F), up (R, F), all in xp's
    dtype (gate and up are what the backward needs).

    Per expert, the dense MLP ops on its rows: gate = x @ Wg.T, up = x @ Wu.T, h = silu(gate) *
    up, y = h @ Wd.T, each accumulated in the acc dtype and rounded once, as the dense block.
    An expert with no rows is not visited and reads none of its weights.
    """
    n_rows, n_ffn = xp.shape[0], w_gate[0].shape[0]
    yp = np.empty(xp.shape, dtype=xp.dtype)
    gate = np.empty((n_rows, n_ffn), dtype=xp.dtype)
    up_ = np.empty((n_rows, n_ffn), dtype=xp.dtype)
    for e in range(offsets.size - 1):
        r0, r1 = int(offsets[e]), int(offsets[e + 1])
        if r0 == r1:
            continue
        xs = xp[r0:r1]
        gate[r0:r1] = linear_fwd(xs, w_gate[e])
        up_[r0:r1] = linear_fwd(xs, w_up[e])
        yp[r0:r1] = linear_fwd(swiglu_fwd(gate[r0:r1], up_[r0:r1]), w_down[e])
    return yp, gate, up_


def experts_bwd(xp: np.ndarray, offsets: np.ndarray, w_gate, w_up, w_down, gate: np.ndarray,
                up_: np.ndarray, dyp: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """xp (R, D), gate and up (R, F) from experts_fwd, dyp (R, D) -> dxp (R, D) in xp's dtype;
    dw_gate, dw_up (N, F, D) and dw_down (N, D, F) stacked in the acc dtype.

    Per expert: h = silu(gate) * up recomputed, dWd = dy.T @ h, dh = dy @ Wd, (dgate, dup) =
    swiglu_bwd, dWg = dgate.T @ x, dWu = dup.T @ x, dx = dgate @ Wg + dup @ Wu summed in the
    acc dtype and rounded once. An expert with no rows keeps dW = 0 and costs nothing.
    """
    dt = acc_dtype(xp, dyp, w_gate[0])
    n_experts, (n_ffn, dim) = offsets.size - 1, w_gate[0].shape
    dxp = np.empty(xp.shape, dtype=xp.dtype)
    dw_gate = np.zeros((n_experts, n_ffn, dim), dtype=dt)
    dw_up = np.zeros((n_experts, n_ffn, dim), dtype=dt)
    dw_down = np.zeros((n_experts, dim, n_ffn), dtype=dt)
    for e in range(n_experts):
        r0, r1 = int(offsets[e]), int(offsets[e + 1])
        if r0 == r1:
            continue
        xs, g, u = xp[r0:r1], gate[r0:r1], up_[r0:r1]
        dh, dw_down[e] = linear_bwd(swiglu_fwd(g, u), w_down[e], dyp[r0:r1])
        dg, du = swiglu_bwd(g, u, dh)
        dgf, duf = up(dg, dt), up(du, dt)
        dxp[r0:r1] = (dgf @ up(w_gate[e], dt) + duf @ up(w_up[e], dt)).astype(xp.dtype)
        dw_gate[e] = dgf.T @ up(xs, dt)
        dw_up[e] = duf.T @ up(xs, dt)
    return dxp, dw_gate, dw_up, dw_down
