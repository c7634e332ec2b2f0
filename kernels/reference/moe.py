"""The mixture-of-experts feed-forward block, forward and backward, composed from moe_router
and moe_experts: what transformers' OlmoeSparseMoeBlock / Qwen3MoeSparseMoeBlock compute on
the post-attention normed hidden states (the residual add and the norm stay outside). Never
reads a ModelConfig and never keeps state between calls: routing options arrive as arguments,
what the backward needs travels in a MoeSaved, the step-wide sums of the auxiliary losses in
MoeStats and RouterLossTerms.

Shared experts are optional and ungated (DeepSeek-V3's `shared_experts`, summed onto the routed
output); OLMoE and Qwen3-MoE have none, so their blocks pass `shared=()`. Qwen2-MoE's sigmoid
`shared_expert_gate` is not modelled. Shape legend: kernels/__init__.py and moe_router."""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up
from dataflow.kernels.reference.linear import linear_bwd, linear_fwd
from dataflow.kernels.reference.moe_experts import (expert_order, experts_bwd, experts_fwd,
                                                    permute_bwd, permute_fwd, unpermute_bwd,
                                                    unpermute_fwd)
from dataflow.kernels.reference.moe_router import (load_balancing_loss_bwd,
                                                   load_balancing_stats, router_bwd, router_fwd,
                                                   router_logits_bwd, router_z_loss,
                                                   router_z_loss_bwd)
from dataflow.kernels.reference.swiglu import swiglu_bwd, swiglu_fwd


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeWeights:
    """One layer's MoE weights, stored [out, in] as transformers does."""

    router: np.ndarray
    """(N, D): `mlp.gate.weight`."""
    gate: Sequence[np.ndarray]
    """(N, F, D), stacked or a sequence of N matrices: `mlp.experts.{e}.gate_proj.weight`."""
    up: Sequence[np.ndarray]
    """(N, F, D): `mlp.experts.{e}.up_proj.weight`."""
    down: Sequence[np.ndarray]
    """(N, D, F): `mlp.experts.{e}.down_proj.weight`."""
    shared: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] = ()
    """Ungated shared experts, each (gate (Fs, D), up (Fs, D), down (D, Fs)); () for OLMoE and
    Qwen3-MoE."""

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeGrads:
    """Weight gradients of one layer's MoE block for one chunk, acc dtype; shapes as MoeWeights
    with the experts stacked. Experts no token reached have exact zeros."""

    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    shared: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeSaved:
    """What moe_block_bwd needs besides x and the weights (x is the caller's saved input)."""

    norm_topk_prob: bool
    logits: np.ndarray
    """(T, N) acc dtype: the z-loss's gradient needs them."""
    probs: np.ndarray
    """(T, N) acc dtype."""
    topk_idx: np.ndarray
    """(T, k) int64."""
    topk_weight: np.ndarray
    """(T, k) acc dtype: the combine weights."""
    order: np.ndarray
    """(R,) int64: (token * k + slot) of each routed row, grouped by expert."""
    offsets: np.ndarray
    """(N + 1,) int64: expert e owns rows offsets[e]:offsets[e + 1]."""
    gate: np.ndarray
    """(R, F) in x's dtype."""
    up: np.ndarray
    """(R, F) in x's dtype."""
    yp: np.ndarray
    """(R, D) in x's dtype: each row's expert output, needed for the combine weights' grad."""
    shared_gate_up: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    """Per shared expert, its (gate, up) (T, Fs) in x's dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeStats:
    """One layer and chunk's contribution to the step's auxiliary losses; sum them over every
    MoE layer and chunk of a forward (moe_router.load_balancing_loss, router_z_loss)."""

    counts: np.ndarray
    """(N,) int64: (token, slot) pairs routed to each expert."""
    prob_sum: np.ndarray
    """(N,) acc dtype: sum over tokens of the router's softmax."""
    lse_sq_sum: float
    """sum over tokens of logsumexp(logits)^2."""
    n_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterLossTerms:
    """The auxiliary losses' share of one layer's backward. Coefficients multiply losses on the
    same scale as the loss whose gradient dy is (transformers: loss = mean CE + aux_coef * aux,
    so with dy from the mean CE pass router_aux_loss_coef itself)."""

    aux_coef: float
    aux_counts: np.ndarray
    """(N,) int64: MoeStats.counts summed over every MoE layer and chunk of the forward."""
    aux_rows: int
    """Tokens of the forward x MoE layers: the rows load_balancing_loss averages over."""
    z_coef: float = 0.0
    z_rows: int = 1
    """The rows router_z_loss averages over (see there)."""


def moe_block_fwd(x: np.ndarray, w: MoeWeights, *, top_k: int, norm_topk_prob: bool
                  ) -> tuple[np.ndarray, MoeSaved, MoeStats]:
    """x (T, D) normed hidden states -> y (T, D) in x's dtype, MoeSaved, MoeStats.

    y = sum over the token's k experts of weight * expert(x) (+ each shared expert(x)), the sum
    in the acc dtype, rounded once (shared experts' outputs are rounded before being added,
    as a separate op's output would be).
    """
    logits, probs, topk_idx, topk_weight = router_fwd(x, w.router, top_k,
                                                      norm_topk_prob=norm_topk_prob)
    order, offsets = expert_order(topk_idx, w.n_experts)
    yp, gate, up_ = experts_fwd(permute_fwd(x, order, top_k), offsets, w.gate, w.up, w.down)
    y = unpermute_fwd(yp, order, topk_weight)
    shared_gate_up = []
    if w.shared:
        dt = acc_dtype(x)
        acc = up(y, dt)
        for sg, su, sd in w.shared:
            g, u = linear_fwd(x, sg), linear_fwd(x, su)
            acc = acc + up(linear_fwd(swiglu_fwd(g, u), sd), dt)
            shared_gate_up.append((g, u))
        y = acc.astype(x.dtype)
    counts, prob_sum = load_balancing_stats(probs, topk_idx)
    lse_sq_sum, _ = router_z_loss(logits, 1)
    saved = MoeSaved(norm_topk_prob=norm_topk_prob, logits=logits, probs=probs,
                     topk_idx=topk_idx, topk_weight=topk_weight, order=order, offsets=offsets,
                     gate=gate, up=up_, yp=yp, shared_gate_up=tuple(shared_gate_up))
    stats = MoeStats(counts=counts, prob_sum=prob_sum, lse_sq_sum=lse_sq_sum,
                     n_tokens=x.shape[0])
    return y, saved, stats


def moe_block_bwd(x: np.ndarray, w: MoeWeights, saved: MoeSaved, dy: np.ndarray,
                  losses: RouterLossTerms | None = None) -> tuple[np.ndarray, MoeGrads]:
    """x (T, D), dy (T, D) -> dx (T, D) in x's dtype, MoeGrads in the acc dtype.

    dx sums the experts' path (through the permutation), the router's path (through the
    selected weights and, with `losses`, the load-balancing and z-loss gradients) and the
    shared experts', in the acc dtype, rounded once.
    """
    top_k = saved.topk_idx.shape[1]
    dt = acc_dtype(x, dy)
    dyp, d_topk_weight = unpermute_bwd(dy, saved.yp, saved.order, saved.topk_weight)
    dxp, dw_gate, dw_up, dw_down = experts_bwd(permute_fwd(x, saved.order, top_k),
                                               saved.offsets, w.gate, w.up, w.down,
                                               saved.gate, saved.up, dyp)
    d_logits = router_logits_bwd(saved.probs, saved.topk_idx, d_topk_weight,
                                 norm_topk_prob=saved.norm_topk_prob)
    if losses is not None:
        if losses.aux_coef:
            d_logits = d_logits + load_balancing_loss_bwd(saved.probs, losses.aux_counts,
                                                          losses.aux_rows, losses.aux_coef)
        if losses.z_coef:
            _, lse = router_z_loss(saved.logits, 1)
            d_logits = d_logits + router_z_loss_bwd(saved.logits, lse, losses.z_rows,
                                                    losses.z_coef)
    dx_router, dw_router = router_bwd(x, w.router, d_logits)
    dx = up(dx_router, dt) + permute_bwd(dxp, saved.order, top_k)
    d_shared = []
    for (sg, su, sd), (g, u) in zip(w.shared, saved.shared_gate_up):
        dh, dw_sd = linear_bwd(swiglu_fwd(g, u), sd, dy)
        dg, du = swiglu_bwd(g, u, dh)
        dgf, duf = up(dg, dt), up(du, dt)
        dx = dx + dgf @ up(sg, dt) + duf @ up(su, dt)
        d_shared.append((dgf.T @ up(x, dt), duf.T @ up(x, dt), dw_sd))
    grads = MoeGrads(router=dw_router, gate=dw_gate, up=dw_up, down=dw_down,
                     shared=tuple(d_shared))
    return dx.astype(x.dtype), grads
