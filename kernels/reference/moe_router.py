"""Router of a mixture-of-experts feed-forward block as transformers' OlmoeSparseMoeBlock and
Qwen3MoeSparseMoeBlock compute it (logits = x @ w_router.T, softmax, top-k, optional
renormalisation of the k weights), and the two auxiliary losses on its logits (load balancing,
z-loss), forward and backward. Routing is dropless: every token reaches its k experts, there is
no capacity factor. Never reads a config and never keeps state between calls: counts, row totals
and coefficients arrive as plain numbers.

Shape legend beyond `kernels/__init__.py`: N routed experts, k experts per token (top_k),
R = T * k routed rows. Logits, probabilities, routing weights and every gradient here are in the
acc dtype (fp32 for bf16 inputs): transformers rounds the logits to the input dtype before its
fp32 softmax; we do not, so routing decisions follow the unrounded scores (docs/moe.md)."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (T, N) logits in their own dtype, max subtracted first."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _softmax_bwd(probs: np.ndarray, d_probs: np.ndarray) -> np.ndarray:
    """d_logits = p * (dp - sum(dp * p)) row-wise: the softmax's Jacobian applied to dp."""
    return probs * (d_probs - np.sum(d_probs * probs, axis=1, keepdims=True))


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    mx = logits.max(axis=1)
    return mx + np.log(np.sum(np.exp(logits - mx[:, None]), axis=1))


def router_topk(probs: np.ndarray, top_k: int) -> np.ndarray:
    """probs (T, N) -> topk_idx (T, k) int64: each row's k largest, largest first.

    Equal probabilities are ordered by the lower expert index first (a stable sort on -p). We
    assume torch.topk on CPU does the same; torch does not document it, so this rule is our
    definition, and the CUDA top-k must sort by the key (-p, expert) to match it.
    """
    n_experts = probs.shape[1]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k {top_k} is outside 1..{n_experts} (the number of experts); "
                         f"pass num_experts_per_tok of the model's config")
    return np.argsort(-probs, axis=1, kind="stable")[:, :top_k].astype(np.int64)


def router_fwd(x: np.ndarray, w_router: np.ndarray, top_k: int, *, norm_topk_prob: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (T, D), w_router (N, D) -> logits (T, N), probs (T, N), topk_idx (T, k) int64,
    topk_weight (T, k); floats in the acc dtype.

    probs = softmax(x @ w_router.T); topk_weight are the selected probs, divided by their sum
    when norm_topk_prob (Qwen3-MoE: true; OLMoE: false).
    """
    dt = acc_dtype(x, w_router)
    logits = up(x, dt) @ up(w_router, dt).T
    probs = _softmax(logits)
    topk_idx = router_topk(probs, top_k)
    topk_weight = np.take_along_axis(probs, topk_idx, axis=1)
    if norm_topk_prob:
        topk_weight = topk_weight / topk_weight.sum(axis=1, keepdims=True)
    return logits, probs, topk_idx, topk_weight


def router_logits_bwd(probs: np.ndarray, topk_idx: np.ndarray, d_topk_weight: np.ndarray, *,
                      norm_topk_prob: bool) -> np.ndarray:
    """probs (T, N), topk_idx (T, k), d_topk_weight (T, k) -> d_logits (T, N), acc dtype.

    The gradient reaches the logits only through the k selected probabilities (the selection
    itself is piecewise constant), as autograd does through transformers' torch.topk; the
    softmax then spreads it over all N logits. With renormalisation w = v / sum(v):
    dv = (dw - sum(dw * w)) / sum(v).
    """
    dt = acc_dtype(probs, d_topk_weight)
    p, dw = up(probs, dt), up(d_topk_weight, dt)
    v = np.take_along_axis(p, topk_idx, axis=1)
    if norm_topk_prob:
        s = v.sum(axis=1, keepdims=True)
        dv = (dw - np.sum(dw * (v / s), axis=1, keepdims=True)) / s
    else:
        dv = dw
    d_probs = np.zeros_like(p)
    np.put_along_axis(d_probs, topk_idx, dv, axis=1)
    return _softmax_bwd(p, d_probs)


def router_bwd(x: np.ndarray, w_router: np.ndarray,
               d_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D), w_router (N, D), d_logits (T, N) -> dx (T, D), dw_router (N, D), both in the acc
    dtype: dx stays unrounded because the block adds the experts' dx to it before its one
    rounding. d_logits is the sum of router_logits_bwd and the auxiliary losses' gradients."""
    dt = acc_dtype(x, w_router, d_logits)
    dl = up(d_logits, dt)
    return dl @ up(w_router, dt), dl.T @ up(x, dt)


# --- load-balancing loss (transformers' load_balancing_loss_func) ---------------------------


def load_balancing_stats(probs: np.ndarray,
                         topk_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """probs (T, N), topk_idx (T, k) -> counts (N,) int64, prob_sum (N,) acc dtype: the two
    sums the loss needs from one layer and chunk. counts[e] is the number of (token, slot)
    pairs routed to e; prob_sum[e] the sum over tokens of probs[:, e]. Add them over every MoE
    layer and chunk of one forward (transformers concatenates all layers' logits)."""
    n_experts = probs.shape[1]
    counts = np.bincount(np.asarray(topk_idx).reshape(-1), minlength=n_experts).astype(np.int64)
    return counts, np.sum(probs, axis=0)


def load_balancing_loss(counts: np.ndarray, prob_sum: np.ndarray, n_rows: int) -> float:
    """counts (N,), prob_sum (N,) summed over all layers and chunks; n_rows = tokens x MoE
    layers -> N * sum_e (counts[e] / n_rows) * (prob_sum[e] / n_rows).

    This is load_balancing_loss_func without attention_mask: tokens_per_expert (k, N) is the
    mean over rows of the one-hot selections (its sum over slots is counts / n_rows, not divided
    by k, so perfect balance gives k), router_prob_per_expert the mean of the softmax.
    """
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens x MoE layers), got {n_rows}")
    n_experts = counts.shape[0]
    f = counts.astype(np.float64) / n_rows
    p = np.asarray(prob_sum, dtype=np.float64) / n_rows
    return float(n_experts * np.sum(f * p))


def load_balancing_loss_bwd(probs: np.ndarray, counts: np.ndarray, n_rows: int,
                            coef: float) -> np.ndarray:
    """probs (T, N) of one layer and chunk, counts (N,) summed over the whole forward ->
    d_logits (T, N) of coef * load_balancing_loss, acc dtype.

    The token fractions are constants (one-hot of a top-k); the mean probability's gradient is
    the same for every row: d loss / d probs[t, e] = coef * N * counts[e] / n_rows^2. So every
    layer's backward needs the counts of all layers, known once the forward has finished.
    """
    dt = acc_dtype(probs)
    p = up(probs, dt)
    n_experts = counts.shape[0]
    d_probs = (coef * n_experts / float(n_rows) ** 2) * counts.astype(dt)
    return _softmax_bwd(p, np.broadcast_to(d_probs, p.shape))


# --- router z-loss (ST-MoE; transformers' switch_transformers router_z_loss_func) -----------


def router_z_loss(logits: np.ndarray, n_rows: int) -> tuple[float, np.ndarray]:
    """logits (T, N), n_rows -> (sum_t lse_t^2 / n_rows, lse (T,) acc dtype).

    z-loss = mean over rows of logsumexp(logits)^2. n_rows is the number of rows the mean runs
    over: the layer's tokens of the whole forward for a per-layer mean (megablocks, which
    OLMoE's own training used), or tokens x layers for one mean over all layers; add the
    partial sums over chunks. transformers' OlmoeForCausalLM has no z-loss (OlmoeConfig has no
    router_z_loss_coef), so a comparison against it uses coefficient 0.
    """
    if n_rows <= 0:
        raise ValueError(f"n_rows must be positive (tokens the mean runs over), got {n_rows}")
    dt = acc_dtype(logits)
    lse = _logsumexp(up(logits, dt))
    return float(np.sum(lse.astype(np.float64) ** 2) / n_rows), lse


def router_z_loss_bwd(logits: np.ndarray, lse: np.ndarray, n_rows: int,
                      coef: float) -> np.ndarray:
    """logits (T, N), lse (T,) from router_z_loss -> d_logits (T, N) of coef * z-loss:
    coef * 2 * lse_t / n_rows * softmax(logits)_t, acc dtype."""
    dt = acc_dtype(logits)
    lg, ls = up(logits, dt), up(lse, dt)
    return (2.0 * coef / n_rows) * ls[:, None] * np.exp(lg - ls[:, None])
