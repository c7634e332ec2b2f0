"""A float64 NumPy transcription of transformers' LlamaForCausalLM loss, independent of
dataflow.kernels.reference: the truth the reference model is tested against (test_reference_trainer,
kernels/test_rope_scaling), and of the families that differ from it in the attention's input only
(MistralForCausalLM computes Llama's; Qwen2ForCausalLM and Qwen3ForCausalLM: _attention_input),
with the head tied to the embedding when the config says so (tie_word_embeddings)."""

from __future__ import annotations

import math

import numpy as np

from dataflow.kernels.reference import IGNORE
from dataflow.models.layout import embed_layout, head_layout, layer_layout
from tests.moe_float64 import sparse_moe_block_float64

_EXPERT = ("gate_proj", "up_proj", "down_proj")


def _attention_input(cfg, p, n, name, heads, norm):
    """(heads, T, E) query, key or value states before RoPE as cfg.family's attention forms
    them from the normed hidden states n (T, D), transcribed from transformers:
    - llama, mistral: `self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)`, no bias;
    - qwen2 (Qwen2Attention): the same with q_proj, k_proj, v_proj built `bias=True`;
    - qwen3 (Qwen3Attention): `self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
      .transpose(1, 2)` (k likewise with k_norm; v plain), Qwen3RMSNorm(head_dim) over the last
      axis; attention_bias False; qwen3_moe (Qwen3MoeAttention) the same;
    - olmoe (OlmoeAttention): `self.q_norm(self.q_proj(hidden_states))`, OlmoeRMSNorm over the
      whole projection (hidden_size for q, kv_dim for k), then the view; clip_qkv None."""
    t, e = n.shape[0], cfg.head_dim
    y = n @ p[f"self_attn.{name}_proj"].T
    if cfg.family == "qwen2":
        y = y + p[f"self_attn.{name}_proj.bias"]
    if cfg.family == "olmoe" and name != "v":  # OlmoeAttention: q_norm(q_proj(x)), then view
        y = norm(y, p[f"self_attn.{name}_norm"])
    y = y.reshape(t, heads, e)
    if cfg.family in ("qwen3", "qwen3_moe") and name != "v":
        y = norm(y, p[f"self_attn.{name}_norm"])
    return y.transpose(1, 0, 2)


def llama_loss_float64(cfg, w, tokens, inv_freq=None, router_logits=None):
    """Summed next-token cross-entropy of transformers' LlamaForCausalLM (or Mistral's, Qwen2's,
    Qwen3's, OLMoE's, Qwen3-MoE's, by cfg.family) transcribed to float64 NumPy, independent of
    dataflow.kernels.reference: rotate_half RoPE, repeat_kv GQA, masked softmax; an MoE
    family's FFN is tests.moe_float64.sparse_moe_block_float64, and each layer's router
    logits (T, N) are appended to `router_logits` when it is a list (the auxiliary loss is
    tests.moe_model_float64's). inv_freq: RoPE's inverse frequencies (E/2,); default the plain
    1 / theta^(2i/E)."""
    if cfg.family not in ("llama", "mistral", "qwen2", "qwen3", "olmoe", "qwen3_moe"):
        raise ValueError(f"no float64 transcription of family {cfg.family!r}")
    inp, tgt = tokens[:-1], tokens[1:]
    t, e = inp.size, cfg.head_dim
    lay_h = head_layout(cfg)

    def norm(x, wt):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.norm_eps) * wt

    if inv_freq is None:
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, e, 2) / e)
    emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)  # (T, E)
    cos, sin = np.cos(emb), np.sin(emb)

    def rope(x):  # (heads, T, E)
        return x * cos + np.concatenate([-x[..., e // 2:], x[..., : e // 2]], axis=-1) * sin

    x = embed_layout(cfg).view(w.embed, "embed_tokens")[inp]
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for block in w.layers:
        p = layer_layout(cfg).views(block)
        n = norm(x, p["input_layernorm"])
        q = rope(_attention_input(cfg, p, n, "q", cfg.n_heads, norm))
        k = rope(_attention_input(cfg, p, n, "k", cfg.n_kv_heads, norm))
        v = _attention_input(cfg, p, n, "v", cfg.n_kv_heads, norm)
        k, v = np.repeat(k, cfg.group_size, axis=0), np.repeat(v, cfg.group_size, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(e) + mask
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(t, cfg.q_dim)
        x = x + o @ p["self_attn.o_proj"].T
        n = norm(x, p["post_attention_layernorm"])
        if cfg.moe is not None:
            y, logits_l = sparse_moe_block_float64(
                n, p["mlp.gate"], [[p[f"mlp.experts.{j}.{t_}"] for t_ in _EXPERT]
                                   for j in range(cfg.moe.n_experts)],
                top_k=cfg.moe.top_k, norm_topk_prob=cfg.moe.norm_topk_prob,
                shared=[[p[f"mlp.shared_experts.{j}.{t_}"] for t_ in _EXPERT]
                        for j in range(cfg.moe.n_shared_experts)])
            if router_logits is not None:
                router_logits.append(logits_l)
            x = x + y
            continue
        g, u = n @ p["mlp.gate_proj"].T, n @ p["mlp.up_proj"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ p["mlp.down_proj"].T
    # tie_word_embeddings: transformers' lm_head.weight is the embedding's Parameter itself
    head = embed_layout(cfg).view(w.embed, "embed_tokens") if cfg.tie_embeddings else \
        lay_h.view(w.head, "lm_head")
    logits = norm(x, lay_h.view(w.head, "norm")) @ head.T
    mx = logits.max(axis=-1)
    lse = mx + np.log(np.sum(np.exp(logits - mx[:, None]), axis=-1))
    valid = tgt != IGNORE
    return float(np.sum(lse[valid] - logits[valid, tgt[valid]]))
