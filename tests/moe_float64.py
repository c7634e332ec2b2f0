"""A float64 NumPy transcription of transformers' sparse MoE feed-forward blocks
(OlmoeSparseMoeBlock, Qwen3MoeSparseMoeBlock: they differ only in norm_topk_prob), of
`load_balancing_loss_func` (shared by Mixtral, OLMoE, Qwen3-MoE) and of switch_transformers'
`router_z_loss_func`, independent of dataflow.kernels.reference: the truth the MoE reference ops
are tested against (tests/kernels/test_moe_reference.py).

The forward follows transformers line by line (one-hot expert mask, a loop over experts,
`torch.where`, `index_add_`). The backward has no autograd to lean on, so it is derived by hand
in a dense form unlike the reference's permutation: every expert runs on every token and is
weighted by a (T, N) combine matrix that is zero off the selected experts. Finite differences
check it (test_float64_transcription_grads_match_finite_differences).

`rnd` emulates a bf16 run of transformers: it is applied wherever torch would round a bf16
tensor (each linear's output, the activation, the product, the routing weights' cast, the
products with them, every index_add_), so `rnd=bf16_round` gives the error that transformers
itself makes in bf16, the yardstick of the bf16 tolerance. Two places are kept exact on
purpose, because our reference keeps them in fp32 and a near-tie rounded differently would
change the routing rather than measure precision: the router logits (transformers rounds them
to bf16 before its fp32 softmax) and the softmax over them."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def exact(a: np.ndarray) -> np.ndarray:
    return a


def bf16_round(a: np.ndarray) -> np.ndarray:
    """a rounded to bf16 and held in float64 again, as a bf16 torch tensor would hold it."""
    return np.asarray(a, dtype=np.float64).astype(BF16).astype(np.float64)


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def topk(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """torch.topk(probs, k, dim=-1) on CPU: values largest first, equal values by the lower
    index first (assumed: torch does not document the order of ties)."""
    idx = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(probs, idx, axis=-1), idx


def mlp_float64(x, gate_proj, up_proj, down_proj, rnd=exact):
    """OlmoeMLP / Qwen3MoeMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = silu."""
    return rnd(rnd(rnd(_silu(rnd(x @ gate_proj.T))) * rnd(x @ up_proj.T)) @ down_proj.T)


def sparse_moe_block_float64(x, router, experts, *, top_k, norm_topk_prob, shared=(),
                             rnd=exact):
    """OlmoeSparseMoeBlock.forward (Qwen3MoeSparseMoeBlock.forward with norm_topk_prob) on
    hidden_states x (T, D) -> (final_hidden_states (T, D), router_logits (T, N)).

    experts: sequence of (gate_proj, up_proj, down_proj) weights. shared: ungated shared
    experts added to the output, as DeepseekV3MoE's `shared_experts` (OLMoE, Qwen3-MoE: none).
    """
    router_logits = x @ router.T                        # self.gate(hidden_states)
    routing_weights = _softmax(router_logits)           # F.softmax(..., dtype=torch.float)
    routing_weights, selected_experts = topk(routing_weights, top_k)
    if norm_topk_prob:
        routing_weights = routing_weights / routing_weights.sum(axis=-1, keepdims=True)
    routing_weights = rnd(routing_weights)              # .to(hidden_states.dtype)
    final_hidden_states = np.zeros_like(x)
    n_experts = router.shape[0]
    # one_hot(selected_experts, num_classes).permute(2, 1, 0): (N, k, T)
    expert_mask = (selected_experts[..., None] == np.arange(n_experts)).transpose(2, 1, 0)
    for expert_idx in range(n_experts):
        idx, top_x = np.nonzero(expert_mask[expert_idx])
        current_state = x[top_x]
        current_hidden_states = rnd(mlp_float64(current_state, *experts[expert_idx], rnd=rnd)
                                    * routing_weights[top_x, idx, None])
        # index_add_: top_x has no repeats within one expert (a token picks an expert once)
        final_hidden_states[top_x] = rnd(final_hidden_states[top_x] + current_hidden_states)
    for sg, su, sd in shared:
        final_hidden_states = rnd(final_hidden_states + mlp_float64(x, sg, su, sd, rnd=rnd))
    return final_hidden_states, router_logits


def sparse_moe_block_grads_float64(x, router, experts, dy, *, top_k, norm_topk_prob, shared=(),
                                   d_logits_extra=None, rnd=exact):
    """Gradients of sum(final_hidden_states * dy) (+ the auxiliary losses through
    d_logits_extra (T, N)) -> dict with dx (T, D), router (N, D), gate/up/down: lists of each
    expert's matrices, shared: list of (gate, up, down). Dense form; `rnd` rounds every
    backward intermediate as a bf16 autograd run would."""
    t, n_experts = x.shape[0], router.shape[0]
    probs = _softmax(x @ router.T)
    v, sel = topk(probs, top_k)
    s = v.sum(axis=-1, keepdims=True)
    w = v / s if norm_topk_prob else v
    combine = np.zeros((t, n_experts))                  # (T, N), zero off the selection
    np.put_along_axis(combine, sel, rnd(w), axis=-1)
    grads = {"gate": [], "up": [], "down": [], "shared": []}
    dx = np.zeros_like(x)
    d_combine = np.zeros((t, n_experts))

    def mlp_bwd(d_out, wg, wu, wd):
        g, u = rnd(x @ wg.T), rnd(x @ wu.T)
        sg = 1.0 / (1.0 + np.exp(-g))
        a = rnd(g * sg)
        h = rnd(a * u)
        dh = rnd(d_out @ wd)
        dg = rnd(rnd(dh * u) * (sg + g * sg * (1.0 - sg)))
        du = rnd(dh * a)
        return rnd(dg @ wg) + rnd(du @ wu), rnd(dg.T @ x), rnd(du.T @ x), rnd(d_out.T @ h)

    for e in range(n_experts):
        wg, wu, wd = experts[e]
        d_combine[:, e] = np.sum(dy * mlp_float64(x, wg, wu, wd, rnd=rnd), axis=-1)
        dxe, dwg, dwu, dwd = mlp_bwd(rnd(combine[:, e:e + 1] * dy), wg, wu, wd)
        dx += dxe
        grads["gate"].append(dwg)
        grads["up"].append(dwu)
        grads["down"].append(dwd)
    for wg, wu, wd in shared:
        dxe, dwg, dwu, dwd = mlp_bwd(dy, wg, wu, wd)
        dx += dxe
        grads["shared"].append((dwg, dwu, dwd))
    dw = np.take_along_axis(d_combine, sel, axis=-1)    # only the selected entries matter
    dv = (dw - np.sum(dw * w, axis=-1, keepdims=True)) / s if norm_topk_prob else dw
    d_probs = np.zeros_like(probs)
    np.put_along_axis(d_probs, sel, dv, axis=-1)
    d_logits = probs * (d_probs - np.sum(d_probs * probs, axis=-1, keepdims=True))
    if d_logits_extra is not None:
        d_logits = d_logits + d_logits_extra
    grads["dx"] = dx + d_logits @ router
    grads["router"] = d_logits.T @ x
    return grads


def load_balancing_loss_float64(gate_logits, num_experts, top_k):
    """load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask=None):
    gate_logits a tuple of every layer's (T, N) router logits."""
    concatenated_gate_logits = np.concatenate(gate_logits, axis=0)
    routing_weights = _softmax(concatenated_gate_logits)
    _, selected_experts = topk(routing_weights, top_k)
    expert_mask = (selected_experts[..., None] == np.arange(num_experts)).astype(np.float64)
    tokens_per_expert = np.mean(expert_mask, axis=0)              # (k, N)
    router_prob_per_expert = np.mean(routing_weights, axis=0)     # (N,)
    overall_loss = np.sum(tokens_per_expert * router_prob_per_expert[None, :])
    return overall_loss * num_experts


def load_balancing_loss_grads_float64(gate_logits, num_experts, top_k):
    """d load_balancing_loss_float64 / d each layer's logits: a list of (T, N). The one-hot
    token fractions carry no gradient; the mean of the softmax does."""
    concatenated = np.concatenate(gate_logits, axis=0)
    rows = concatenated.shape[0]
    probs = _softmax(concatenated)
    _, sel = topk(probs, top_k)
    f = np.mean((sel[..., None] == np.arange(num_experts)).astype(np.float64), axis=0)
    d_probs = np.broadcast_to(num_experts * f.sum(axis=0) / rows, probs.shape)
    d = probs * (d_probs - np.sum(d_probs * probs, axis=-1, keepdims=True))
    bounds = np.cumsum([0] + [g.shape[0] for g in gate_logits])
    return [d[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def router_z_loss_float64(router_logits):
    """switch_transformers' router_z_loss_func on logits (..., N): the mean over all rows of
    logsumexp(logits)^2."""
    mx = router_logits.max(axis=-1)
    log_z = mx + np.log(np.sum(np.exp(router_logits - mx[..., None]), axis=-1))
    return float(np.sum(log_z**2) / log_z.size)
