"""The whole Llama-style model for ONE sequence, forward and backward, composed only from the
reference ops of this package: the slow, exact oracle that the engine's rounds and chunks must
reproduce. No chunking, no recompute, no placement: every activation of the sequence is kept.
Never imports anything of ours outside dataflow.kernels.reference and dataflow.models.layout (it lives in
dataflow/ because kernels/ must not depend on models/).

Per layer (transformers' LlamaDecoderLayer):
    h   = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1))),  n1 = norm1(x)
    out = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),                       n2 = norm2(h)
then the final norm, lm_head and the cross-entropy summed over the tokens. With cfg.moe the FFN
is kernels.reference.moe's block (router, top-k, experts) on n2, and the load-balancing (and
z-) loss over every MoE layer adds its gradient to the routers' (RouterTotals, docs/moe.md). With
cfg.attention_bias (Qwen2) the q, k and v projections add their biases; with cfg.qk_norm (Qwen3)
each head of q and of k goes through an RMSNorm over head_dim before RoPE
(rope(q_norm(q_proj(n1))), likewise k). With cfg.tie_embeddings lm_head is the embedding table,
and its gradient the sum of the head's and the lookup's.

Dtypes: activations (and their gradients) are stored in `act_dtype`, the weights' dtype unless
asked otherwise (bf16 weights -> bf16 activations as the engine stores them; float64 weights ->
float64 throughout, for gradient checks). Every op computes in the acc dtype (fp32, or float64
when an input is float64) and rounds its output once; the residual sums below do the same."""

from __future__ import annotations

import numpy as np

from dataflow.rope import rope_table
from dataflow.kernels.reference import acc_dtype
from dataflow.kernels.reference.attention import attention_bwd, attention_fwd
from dataflow.kernels.reference.embedding import embedding_bwd, embedding_fwd
from dataflow.kernels.reference.head_loss import IGNORE, head_loss_fwd_bwd
from dataflow.kernels.reference.linear import bias_bwd, linear_bwd, linear_fwd
from dataflow.kernels.reference.moe import (MoeStats, MoeWeights, RouterLossTerms,
                                            moe_block_bwd, moe_block_fwd)
from dataflow.kernels.reference.moe_router import load_balancing_loss
from dataflow.kernels.reference.rms_norm import rms_norm_bwd, rms_norm_fwd
from dataflow.kernels.reference.rope import rope_bwd, rope_fwd
from dataflow.kernels.reference.swiglu import swiglu_bwd, swiglu_fwd
from dataflow.models.layout import (ROUTER_TENSOR, embed_layout, expert_names, head_layout,
                                    layer_layout)


class Grads:
    """Gradients in the weights' block structure: `embed`, `layers` (one per layer), `head`,
    each a 1-D array of the block's numel in the acc dtype, zero in the alignment padding."""

    def __init__(self, embed: np.ndarray, layers: list[np.ndarray], head: np.ndarray):
        self.embed, self.layers, self.head = embed, layers, head
        self.router = None
        """With an MoE model, the RouterTotals the auxiliary losses' gradients used."""

    def blocks(self) -> list[np.ndarray]:
        """Every block, in file order (embed, layers..., head)."""
        return [self.embed, *self.layers, self.head]


def _add(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """a + b computed in the acc dtype and rounded once to `dtype` (a residual sum)."""
    dt = acc_dtype(a, b)
    return (a.astype(dt) + b.astype(dt)).astype(dtype)


def _head_proj(cfg, w: dict, n1: np.ndarray, name: str, heads: int, pos, saved: dict | None,
               rope: bool = True) -> np.ndarray:
    """One of q, k, v of the attention input n1 (T, D) -> (T, heads, E): the projection (plus
    its bias with attention_bias), the per-head RMSNorm of q and k with qk_norm (over the whole
    projection with qk_norm_whole, OLMoE's; its input and
    rstd kept in `saved` as '{name}_pre', '{name}_rstd'), RoPE when `rope`."""
    t, e = n1.shape[0], cfg.head_dim
    y = linear_fwd(n1, w[f"self_attn.{name}_proj"],
                   w[f"self_attn.{name}_proj.bias"] if cfg.attention_bias else None)
    y = y.reshape(t, heads, e)
    if cfg.qk_norm and name in ("q", "k"):
        rows = (t, heads * e) if cfg.qk_norm_whole else (t * heads, e)  # OLMoE: whole projection
        yn, rstd = rms_norm_fwd(y.reshape(rows), w[f"self_attn.{name}_norm"],
                                cfg.norm_eps)                      # (T*heads, E), (T*heads,)
        if saved is not None:
            saved[f"{name}_pre"], saved[f"{name}_rstd"] = y, rstd
        y = yn.reshape(t, heads, e)
    return rope_fwd(y, pos, rope_table(cfg)) if rope else y


def qkv_fwd(cfg, w: dict, n1: np.ndarray, pos, saved: dict | None = None):
    """(q (T, H, E), k (T, K, E), v (T, K, E)) of the attention input n1 (T, D): roped q and k
    as the attention sees them (see _head_proj). Shared with dataflow.host_forward."""
    return (_head_proj(cfg, w, n1, "q", cfg.n_heads, pos, saved),
            _head_proj(cfg, w, n1, "k", cfg.n_kv_heads, pos, saved),
            _head_proj(cfg, w, n1, "v", cfg.n_kv_heads, pos, saved, rope=False))


def _head_proj_bwd(cfg, w: dict, a: dict, name: str, dy: np.ndarray, dw: dict) -> np.ndarray:
    """dy (T, heads, E), the gradient of the projection's output after the QK-norm (before
    RoPE's backward is taken off: the caller did) -> the gradient of the projection's output
    (T, heads * E); writes the QK-norm weight's and the bias's gradients into `dw`."""
    t, heads, e = dy.shape
    if cfg.qk_norm and name in ("q", "k"):
        rows = (t, heads * e) if cfg.qk_norm_whole else (t * heads, e)
        dy, dw[f"self_attn.{name}_norm"][...] = rms_norm_bwd(
            a[f"{name}_pre"].reshape(rows), w[f"self_attn.{name}_norm"],
            a[f"{name}_rstd"], dy.reshape(rows))
    dy = dy.reshape(t, heads * e)
    if cfg.attention_bias:
        dw[f"self_attn.{name}_proj.bias"][...] = bias_bwd(dy)
    return dy


def _layer_fwd(cfg, w: dict, x: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, dict]:
    """x (T, D) -> out (T, D) and everything the backward needs."""
    t = x.shape[0]
    n1, rstd1 = rms_norm_fwd(x, w["input_layernorm"], cfg.norm_eps)
    extra: dict = {}
    q, k, v = qkv_fwd(cfg, w, n1, pos, extra)
    o, lse = attention_fwd(q, k, v)                     # (T, H, E), (H, T)
    o = o.reshape(t, cfg.q_dim)
    h = _add(x, linear_fwd(o, w["self_attn.o_proj"]), x.dtype)
    n2, rstd2 = rms_norm_fwd(h, w["post_attention_layernorm"], cfg.norm_eps)
    saved = dict(x=x, n1=n1, rstd1=rstd1, q=q, k=k, v=v, o=o, lse=lse, h=h, n2=n2,
                 rstd2=rstd2, **extra)
    if cfg.moe is not None:
        y, saved["moe"], saved["moe_stats"] = moe_block_fwd(
            n2, moe_weights(cfg, w), top_k=cfg.moe.top_k, norm_topk_prob=cfg.moe.norm_topk_prob)
        return _add(h, y, x.dtype), saved
    gate = linear_fwd(n2, w["mlp.gate_proj"])           # (T, F)
    up = linear_fwd(n2, w["mlp.up_proj"])
    s = swiglu_fwd(gate, up)
    out = _add(h, linear_fwd(s, w["mlp.down_proj"]), x.dtype)
    saved.update(gate=gate, up=up, s=s)
    return out, saved


def layer_forward(cfg, w: dict, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """One decoder layer's output alone, x (T, D) -> (T, D), for forward-only passes
    (dataflow.host_forward): _layer_fwd, its saved activations dropped."""
    return _layer_fwd(cfg, w, x, pos)[0]


def moe_weights(cfg, w: dict) -> MoeWeights:
    """A layer's MoE weights as views of its block's tensors (w: layout.views of the block)."""
    m = cfg.moe
    routed = [[w[n] for n in expert_names(e)] for e in range(m.n_experts)]
    gate, up, down = (list(t) for t in zip(*routed))
    shared = tuple(tuple(w[n] for n in expert_names(e, shared=True))
                   for e in range(m.n_shared_experts))
    return MoeWeights(router=w[ROUTER_TENSOR], gate=gate, up=up, down=down, shared=shared)


def _moe_bwd(cfg, w: dict, a: dict, dout: np.ndarray, dw: dict,
             losses: RouterLossTerms | None) -> np.ndarray:
    """The MoE FFN's backward: dout (T, D) -> dn2 (T, D); router and expert gradients into dw."""
    dn2, g = moe_block_bwd(a["n2"], moe_weights(cfg, w), a["moe"], dout, losses)
    dw[ROUTER_TENSOR][...] = g.router
    for e in range(cfg.moe.n_experts):
        for name, grad in zip(expert_names(e), (g.gate[e], g.up[e], g.down[e])):
            dw[name][...] = grad
    for e, grads in enumerate(g.shared):
        for name, grad in zip(expert_names(e, shared=True), grads):
            dw[name][...] = grad
    return dn2


def _layer_bwd(cfg, w: dict, a: dict, dout: np.ndarray, pos: np.ndarray,
               dw: dict, losses: RouterLossTerms | None = None) -> np.ndarray:
    """dout (T, D) -> dx (T, D); writes every weight gradient of the layer into `dw` (views).
    losses: the auxiliary losses' share of an MoE layer's router gradient (None: none)."""
    t, act = dout.shape[0], dout.dtype
    if cfg.moe is not None:
        dn2 = _moe_bwd(cfg, w, a, dout, dw, losses)
    else:
        ds, dw["mlp.down_proj"][...] = linear_bwd(a["s"], w["mlp.down_proj"], dout)
        dgate, dup = swiglu_bwd(a["gate"], a["up"], ds)
        dn2_gate, dw["mlp.gate_proj"][...] = linear_bwd(a["n2"], w["mlp.gate_proj"], dgate)
        dn2_up, dw["mlp.up_proj"][...] = linear_bwd(a["n2"], w["mlp.up_proj"], dup)
        dn2 = _add(dn2_gate, dn2_up, act)
    dh_ffn, dw["post_attention_layernorm"][...] = rms_norm_bwd(
        a["h"], w["post_attention_layernorm"], a["rstd2"], dn2)
    dh = _add(dout, dh_ffn, act)                         # residual: h feeds out directly too
    do, dw["self_attn.o_proj"][...] = linear_bwd(a["o"], w["self_attn.o_proj"], dh)
    do = do.reshape(t, cfg.n_heads, cfg.head_dim)
    dq, dk, dv = attention_bwd(a["q"], a["k"], a["v"], a["o"].reshape(do.shape), a["lse"], do)
    dq = _head_proj_bwd(cfg, w, a, "q", rope_bwd(dq, pos, rope_table(cfg)), dw)
    dk = _head_proj_bwd(cfg, w, a, "k", rope_bwd(dk.astype(act), pos, rope_table(cfg)), dw)
    dv = _head_proj_bwd(cfg, w, a, "v", dv.astype(act), dw)
    dn1_q, dw["self_attn.q_proj"][...] = linear_bwd(a["n1"], w["self_attn.q_proj"], dq)
    dn1_k, dw["self_attn.k_proj"][...] = linear_bwd(a["n1"], w["self_attn.k_proj"], dk)
    dn1_v, dw["self_attn.v_proj"][...] = linear_bwd(a["n1"], w["self_attn.v_proj"], dv)
    dn1 = _add(_add(dn1_q, dn1_k, act), dn1_v, act)
    dx_attn, dw["input_layernorm"][...] = rms_norm_bwd(
        a["x"], w["input_layernorm"], a["rstd1"], dn1)
    return _add(dh, dx_attn, act)                        # residual: x feeds h directly too


class RouterTotals:
    """The MoE layers' routing sums over one forward (every MoE layer of every sequence it
    holds): what the auxiliary losses and their gradients need (kernels.reference.moe.MoeStats
    added up). transformers' load_balancing_loss_func concatenates every layer's router logits
    of the batch of one forward call, so the rows are tokens x MoE layers."""

    def __init__(self, n_experts: int):
        self.counts = np.zeros(n_experts, np.int64)
        self.prob_sum = np.zeros(n_experts, np.float64)
        self.lse_sq_sum = 0.0
        self.rows = 0

    def add(self, stats: MoeStats) -> None:
        self.counts += stats.counts
        self.prob_sum += stats.prob_sum
        self.lse_sq_sum += stats.lse_sq_sum
        self.rows += stats.n_tokens

    def merge(self, other: "RouterTotals") -> None:
        self.counts += other.counts
        self.prob_sum += other.prob_sum
        self.lse_sq_sum += other.lse_sq_sum
        self.rows += other.rows

    @property
    def aux_loss(self) -> float:
        """The load-balancing loss (unscaled by its coefficient)."""
        return load_balancing_loss(self.counts, self.prob_sum, self.rows)

    @property
    def z_loss(self) -> float:
        """The router z-loss, mean over the same rows of logsumexp(logits)^2 (unscaled)."""
        return self.lse_sq_sum / self.rows

    def terms(self, cfg, scale: float = 1.0) -> RouterLossTerms:
        """The layers' share of the backward with cfg.moe's coefficients times `scale`, on the
        scale of a mean cross-entropy (transformers: loss = mean CE + coef * aux; a step of R
        micro-batches averaging their auxiliary losses passes scale 1 / R)."""
        m = cfg.moe
        return RouterLossTerms(aux_coef=m.router_aux_loss_coef * scale, aux_counts=self.counts,
                               aux_rows=self.rows, z_coef=m.router_z_loss_coef * scale,
                               z_rows=self.rows)


class SequenceForward:
    """One sequence's forward and head (the loss and its gradient at the final norm's output),
    with every activation kept: what `backward` continues from. `router` holds this sequence's
    RouterTotals (None for a dense model)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def forward(cfg, weights, tokens: np.ndarray, grad_scale: float = 1.0, *, act_dtype=None,
            labels: np.ndarray | None = None) -> SequenceForward:
    """The first half of forward_backward (same arguments): embedding, layers, final norm and
    the head's loss and backward. Split from the layers' backward so that a batch's MoE
    auxiliary loss, which couples every sequence and layer of one forward, is known before any
    layer's backward (dataflow.reference_trainer)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(f"tokens must be one sequence of shape (seqlen + 1,), got shape "
                         f"{tokens.shape}; pass one row of the batch at a time")
    inputs = tokens[:-1]
    targets = tokens[1:] if labels is None else np.asarray(labels)[1:]
    if targets.shape != inputs.shape:
        raise ValueError(f"labels must have the tokens' shape {tokens.shape}, got "
                         f"{np.asarray(labels).shape}")
    bad = (inputs < 0) | (inputs >= cfg.vocab_size)
    bad_t = ((targets < 0) & (targets != IGNORE)) | (targets >= cfg.vocab_size)
    if bad.any() or bad_t.any():
        value = inputs[bad][0] if bad.any() else targets[bad_t][0]
        raise ValueError(f"token id {value} is outside the vocabulary [0, {cfg.vocab_size}) of "
                         f"model '{cfg.name}' (only targets may be IGNORE = {IGNORE}); "
                         "check the tokenizer matches the model")
    act = np.dtype(act_dtype) if act_dtype is not None else weights.embed.dtype
    lay_e, lay_l, lay_h = embed_layout(cfg), layer_layout(cfg), head_layout(cfg)
    layer_w = [lay_l.views(b) for b in weights.layers]
    table = lay_e.view(weights.embed, "embed_tokens")
    norm_w = lay_h.view(weights.head, "norm")
    lm_head = table if cfg.tie_embeddings else lay_h.view(weights.head, "lm_head")
    pos = np.arange(inputs.size)

    # Forward, keeping every layer's activations.
    x = embedding_fwd(inputs, table).astype(act)         # (T, D)
    saved = []
    router = None if cfg.moe is None else RouterTotals(cfg.moe.n_experts)
    for w in layer_w:
        x, a = _layer_fwd(cfg, w, x, pos)
        saved.append(a)
        if router is not None:
            router.add(a["moe_stats"])
    xn, rstd = rms_norm_fwd(x, norm_w, cfg.norm_eps)
    loss_sum, n_tokens, dxn, dlm = head_loss_fwd_bwd(xn, lm_head, targets, grad_scale=grad_scale)
    return SequenceForward(cfg=cfg, weights=weights, inputs=inputs, pos=pos, layer_w=layer_w,
                           saved=saved, x=x, rstd=rstd, norm_w=norm_w, dxn=dxn, dlm=dlm,
                           loss_sum=loss_sum, n_tokens=n_tokens, router=router)


def backward(f: SequenceForward, router: RouterTotals | None = None,
             aux_scale: float = 1.0) -> Grads:
    """The layers' backward of a `forward`: gradients of grad_scale * loss_sum, plus, for an
    MoE model, of aux_scale x cfg.moe's coefficients times the auxiliary losses over `router`
    (the totals of the whole forward the sequence belongs to; default its own, f.router).
    Grads.router is the totals used."""
    cfg, weights = f.cfg, f.weights
    lay_e, lay_l, lay_h = embed_layout(cfg), layer_layout(cfg), head_layout(cfg)
    grad_dtype = acc_dtype(weights.embed)
    router = f.router if router is None else router
    losses = None if cfg.moe is None else router.terms(cfg, aux_scale)
    # Backward, writing weight gradients straight into zeroed blocks (padding stays zero).
    grads = Grads(np.zeros(lay_e.numel, grad_dtype),
                  [np.zeros(lay_l.numel, grad_dtype) for _ in weights.layers],
                  np.zeros(lay_h.numel, grad_dtype))
    grads.router = router
    dtable = lay_e.view(grads.embed, "embed_tokens")
    if cfg.tie_embeddings:  # one parameter: the head's part first, as the engine adds them
        dtable[...] = f.dlm
    else:
        lay_h.view(grads.head, "lm_head")[...] = f.dlm
    dx, lay_h.view(grads.head, "norm")[...] = rms_norm_bwd(f.x, f.norm_w, f.rstd, f.dxn)
    for layer in reversed(range(len(f.layer_w))):
        dx = _layer_bwd(cfg, f.layer_w[layer], f.saved[layer], dx, f.pos,
                        lay_l.views(grads.layers[layer]), losses)
    if cfg.pad_token_id is not None:  # nn.Embedding(padding_idx): that row's lookup adds none
        dx = np.where((f.inputs == cfg.pad_token_id)[..., None], dx.dtype.type(0), dx)
    dtable += embedding_bwd(f.inputs, dx, cfg.vocab_size)
    return grads


def forward_backward(cfg, weights, tokens: np.ndarray, grad_scale: float = 1.0, *,
                     act_dtype=None, labels: np.ndarray | None = None) -> tuple[float, int, Grads]:
    """Loss and gradients of one sequence.

    cfg: dataflow.models.config.ModelConfig. weights: any object with `.embed`, `.layers`, `.head`, 1-D
    blocks laid out by dataflow.models.layout (bf16, or float64 for gradient checks), e.g.
    dataflow.models.init.ModelWeights. tokens (S+1,) int: inputs tokens[:-1], targets tokens[1:] (a target
    equal to dataflow.kernels.reference.IGNORE is skipped). labels (S+1,) int: targets labels[1:] instead
    of tokens[1:] (transformers' shift; IGNORE masks). act_dtype: dtype activations are stored in
    (default: the weights' dtype).

    Returns (loss_sum, n_tokens, grads): loss_sum the cross-entropy summed over the n_tokens
    valid targets (float, unscaled); grads the gradient of grad_scale * loss_sum in the acc dtype
    (fp32 for bf16 weights, float64 for float64 weights), in the weights' block structure.
    With cfg.moe the gradient also holds cfg.moe's coefficients times this sequence's auxiliary
    losses (loss = grad_scale * loss_sum + aux_coef * aux + z_coef * z: transformers' objective
    when grad_scale is 1 / n_tokens), whose values grads.router carries (loss_sum stays the
    language model's).
    """
    f = forward(cfg, weights, tokens, grad_scale, act_dtype=act_dtype, labels=labels)
    return f.loss_sum, f.n_tokens, backward(f)
