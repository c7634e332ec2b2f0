"""A float64 NumPy transcription of transformers' LlamaForCausalLM loss, independent of
dataflow.kernels.reference: the truth the reference model is tested against (test_reference_trainer,
kernels/test_rope_scaling)."""

from __future__ import annotations

import math

import numpy as np

from dataflow.kernels.reference import IGNORE
from dataflow.models.layout import embed_layout, head_layout, layer_layout


def llama_loss_float64(cfg, w, tokens, inv_freq=None):
    """Summed next-token cross-entropy of transformers' LlamaForCausalLM transcribed to float64
    NumPy, independent of dataflow.kernels.reference: rotate_half RoPE, repeat_kv GQA, masked softmax.
    inv_freq: RoPE's inverse frequencies (E/2,); default the plain 1 / theta^(2i/E)."""
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
        q = rope((n @ p["self_attn.q_proj"].T).reshape(t, cfg.n_heads, e).transpose(1, 0, 2))
        k = rope((n @ p["self_attn.k_proj"].T).reshape(t, cfg.n_kv_heads, e).transpose(1, 0, 2))
        v = (n @ p["self_attn.v_proj"].T).reshape(t, cfg.n_kv_heads, e).transpose(1, 0, 2)
        k, v = np.repeat(k, cfg.group_size, axis=0), np.repeat(v, cfg.group_size, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(e) + mask
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(t, cfg.q_dim)
        x = x + o @ p["self_attn.o_proj"].T
        n = norm(x, p["post_attention_layernorm"])
        g, u = n @ p["mlp.gate_proj"].T, n @ p["mlp.up_proj"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ p["mlp.down_proj"].T
    logits = norm(x, lay_h.view(w.head, "norm")) @ lay_h.view(w.head, "lm_head").T
    mx = logits.max(axis=-1)
    lse = mx + np.log(np.sum(np.exp(logits - mx[:, None]), axis=-1))
    valid = tgt != IGNORE
    return float(np.sum(lse[valid] - logits[valid, tgt[valid]]))
