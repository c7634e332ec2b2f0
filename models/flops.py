"""FLOP counts per sequence, exactly as ml_dataflow's README defines model FLOPs (causal
attention at half; the head's forward and two backward matmuls; the embedding free), plus the
hardware FLOPs that recompute adds, for HFU. An MoE config (ModelConfig.moe) counts ACTIVE
FLOPs: the router and the top_k routed (and shared) experts each token is sent to, never all N
(flop_model_version says which formula a number used). A head tied to the embedding computes the same
matmuls (over the embedding's table), so its FLOPs do not change. See docs/flops.md. Never
imports array libraries."""

from __future__ import annotations

import enum

from dataflow.models.config import ModelConfig

FLOP_MODEL_VERSION = "mldf-1"
"""Bumped whenever a formula here changes, and printed beside every MFU/HFU we report."""
MOE_FLOP_MODEL_VERSION = "mldf-1-moe-active-2"
"""The version an MoE config's counts carry (flop_model_version): mldf-1 with each layer's FFN
replaced by its active part (router + top_k routed + shared experts, ml_dataflow's E_active).
-2: below FULL the routed experts' recompute counts their down projection too (the backward
needs every row's expert output for the combine weights' gradient); model FLOPs unchanged."""


LORA_FLOP_MODEL_SUFFIX = "+lora-1"
"""Appended to the version of a count with LoRA adapters (docs/flops.md, "LoRA adapters"): the
base's weight-gradient GEMMs left out (frozen), the adapters' GEMMs in."""


def flop_model_version(cfg: ModelConfig, lora: bool = False) -> str:
    """FLOP_MODEL_VERSION for a dense config, MOE_FLOP_MODEL_VERSION with cfg.moe; with LoRA
    adapters (lora=True) LORA_FLOP_MODEL_SUFFIX after it."""
    base = FLOP_MODEL_VERSION if cfg.moe is None else MOE_FLOP_MODEL_VERSION
    return base + LORA_FLOP_MODEL_SUFFIX if lora else base


def ffn_matmul_width(cfg: ModelConfig) -> int:
    """Sum of the output widths of the FFN matmuls one token passes through, per D: 3 * F for
    the dense SwiGLU; with moe the router's N plus 3 * F_e for each of the top_k routed and
    the shared experts (active FLOPs: experts a token is not routed to compute nothing for
    it). Routing, softmax, top-k, permutation and the combine are elementwise: not counted."""
    if cfg.moe is None:
        return 3 * cfg.ffn_dim
    m = cfg.moe
    return m.n_experts + 3 * (m.top_k + m.n_shared_experts) * m.expert_ffn_dim


def _gate_up_width(cfg: ModelConfig) -> int:
    """Output widths of the FFN matmuls a token passes through again below FULL: gate and up,
    2 * F, dense; with moe the router, and all three matrices of each of the top_k routed
    experts (the combine weights' gradient reads every routed row's expert output, so the
    engine re-forms it: dataflow.moe_ffn), gate and up of the shared ones."""
    if cfg.moe is None:
        return 2 * cfg.ffn_dim
    m = cfg.moe
    return m.n_experts + (3 * m.top_k + 2 * m.n_shared_experts) * m.expert_ffn_dim


class SavedLevel(enum.Enum):
    """What the forward pass keeps of one (layer, chunk) for the backward pass."""

    INP_ONLY = "inp_only"
    """Layer input, norm statistics, roped K and V: recompute Q, attention, O-proj and FFN."""
    INP_ATTN = "inp_attn"
    """INP_ONLY plus attention output and log-sum-exp: recompute everything but attention."""
    FULL = "full"
    """Every intermediate: recompute only elementwise work."""


def layer_matmul_flops(cfg: ModelConfig, tokens: int) -> int:
    """Forward matmul FLOPs of one layer for `tokens` tokens: Q,O + K,V + 3 FFN matrices (with
    moe: the router and the active experts' three each, ffn_matmul_width)."""
    d = cfg.model_dim
    return 2 * tokens * d * (2 * cfg.q_dim + 2 * cfg.kv_dim + ffn_matmul_width(cfg))


def causal_pairs(chunk_tokens: int, context_tokens: int) -> float:
    """Query/key pairs a query chunk at offset `context_tokens` scores, counted as ml_dataflow
    does (half of the chunk's own square, so the chunks of a sequence sum to S*S/2)."""
    return chunk_tokens * context_tokens + chunk_tokens * chunk_tokens / 2


def attn_fwd_flops(cfg: ModelConfig, chunk_tokens: int, context_tokens: int = 0) -> float:
    """Two matmuls (QK^T, PV) over the causal pairs: .5 * 2 * (2 * S * S * D) for a whole seq."""
    return 4 * causal_pairs(chunk_tokens, context_tokens) * cfg.q_dim


def attn_bwd_flops(cfg: ModelConfig, chunk_tokens: int, context_tokens: int = 0) -> float:
    """Four matmuls (dP, dS-to-dQ, dK, dV) over the causal pairs: .5 * 4 * (2 * S * S * D)."""
    return 8 * causal_pairs(chunk_tokens, context_tokens) * cfg.q_dim


def head_flops(cfg: ModelConfig, tokens: int) -> int:
    """Head forward, backward-x and backward-w matmuls: 3 * (2 * S * D * V)."""
    return 3 * 2 * tokens * cfg.model_dim * cfg.head_rows


def model_flops_per_seq(cfg: ModelConfig, seqlen: int, *, frozen_layers: int = 0,
                        frozen_head: bool = False) -> float:
    """ml_dataflow's per seq flops: L * (3 * layer matmul + attn fwd + attn bwd) + head, less
    the weight-gradient matmuls that frozen blocks do not run (frozen_flops_per_seq)."""
    per_layer = (3 * layer_matmul_flops(cfg, seqlen) + attn_fwd_flops(cfg, seqlen)
                 + attn_bwd_flops(cfg, seqlen))
    return cfg.n_layers * per_layer + head_flops(cfg, seqlen) \
        - frozen_flops_per_seq(cfg, seqlen, frozen_layers, frozen_head)


def frozen_flops_per_seq(cfg: ModelConfig, seqlen: int, frozen_layers: int,
                         frozen_head: bool) -> float:
    """The weight-gradient matmuls frozen blocks skip (dataflow.memplan.plan.frozen): a frozen
    layer's backward forms dx only (one layer matmul's worth instead of two), a frozen head's
    its backward-x matmul only; a frozen embedding saves nothing here (its lookup and
    scatter-add are not counted). 0 with nothing frozen, so every count made before stands."""
    return frozen_layers * layer_matmul_flops(cfg, seqlen) \
        + frozen_head * 2 * seqlen * cfg.model_dim * cfg.vocab_size


def model_flops_per_token(cfg: ModelConfig, seqlen: int) -> float:
    return model_flops_per_seq(cfg, seqlen) / seqlen


def flash_recompute_flops(cfg: ModelConfig, chunk_tokens: int, context_tokens: int = 0) -> float:
    """The score matrix QK^T that fused attention rebuilds in its backward: .5 * 2 * S * S * D
    per layer for a whole sequence, as ml_dataflow counts it."""
    return 2 * causal_pairs(chunk_tokens, context_tokens) * cfg.q_dim


def qk_norm_reproject_flops(cfg: ModelConfig, level: SavedLevel, chunk_tokens: int) -> float:
    """Projections the backward re-forms only because QK-norm's backward needs their output
    before the norm, which no level keeps (dataflow.layer_ops): K's at every level, and Q's at
    FULL (below FULL, Q is recomputed anyway). 0 without qk_norm. Biases and the norms
    themselves are elementwise: no FLOPs here, as for the other norms and SwiGLU."""
    if not cfg.qk_norm:
        return 0.0
    width = cfg.kv_dim + (cfg.q_dim if level is SavedLevel.FULL else 0)
    return float(2 * chunk_tokens * cfg.model_dim * width)


def level_recompute_flops(cfg: ModelConfig, level: SavedLevel, chunk_tokens: int,
                          context_tokens: int = 0) -> float:
    """Extra forward FLOPs the backward of one (layer, chunk) repeats because of its level
    (plus QK-norm's re-projections, qk_norm_reproject_flops)."""
    d, t = cfg.model_dim, chunk_tokens
    qk = qk_norm_reproject_flops(cfg, level, t)
    if level is SavedLevel.FULL:
        return qk
    q_and_o = 2 * t * d * 2 * cfg.q_dim
    gate_up = 2 * t * d * _gate_up_width(cfg)
    if level is SavedLevel.INP_ATTN:
        return float(q_and_o + gate_up) + qk
    return q_and_o + gate_up + attn_fwd_flops(cfg, t, context_tokens) + qk


def hardware_flops_per_seq(cfg: ModelConfig, seqlen: int, chunk_tokens: int,
                           levels: list[SavedLevel] | tuple[SavedLevel, ...]) -> float:
    """Model FLOPs plus every recompute, for one sequence split into chunks of `chunk_tokens`
    (or packed into one chunk when shorter). `levels[i]` is layer i's level for the sequence's
    chunks; HFU = hardware FLOPs / time / peak."""
    if len(levels) != cfg.n_layers:
        raise ValueError(f"need one level per layer ({cfg.n_layers}), got {len(levels)}")
    t = min(chunk_tokens, seqlen)
    extra = 0.0
    for level in levels:
        for start in range(0, seqlen, t):
            n = min(t, seqlen - start)
            extra += flash_recompute_flops(cfg, n, start)
            extra += level_recompute_flops(cfg, level, n, start)
    return model_flops_per_seq(cfg, seqlen) + extra
