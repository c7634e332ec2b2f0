"""The mixture-of-experts part of a Hugging Face config.json (OlmoeConfig, Qwen3MoeConfig): read
into ModelConfig.moe, refusing by name the variants not modelled, and written back in each
family's spelling. models.hf calls it; the MoE tensors' names and transformers 5's fused expert
tensors stay with the weights there. Never touches tensors or a device."""

from __future__ import annotations

from dataflow.models.config import ModelConfig, MoE, check_count, described
from dataflow.models.errors import ConfigError

DROP = object()
"""A key hf_config_dict leaves out (the family's config class has no such field)."""


def moe_from_hf(data: dict, family: str, arch: str, where) -> MoE:
    """The MoE of an OlmoeConfig / Qwen3MoeConfig dict (defaults as those classes have them);
    refuses by name the variants not modelled: OLMoE's clip_qkv, Qwen3-MoE's dense layers
    (mlp_only_layers, decoder_sparse_step != 1). output_router_logits only says whether
    transformers adds the auxiliary loss in forward; the coefficient is kept either way (the
    reference trainer always adds coef * aux; docs/models.md). `arch`: the family's transformers
    class, for the messages."""
    if family == "olmoe" and data.get("clip_qkv") is not None:
        raise ConfigError(f"{where}: clip_qkv {data['clip_qkv']!r} is not supported for {arch} "
                          "(clipping of q, k and v is not built); import a model with clip_qkv "
                          "null")
    if family == "qwen3_moe":
        dense = data.get("mlp_only_layers") or []
        if dense:
            raise ConfigError(f"{where}: mlp_only_layers {dense!r} is not supported for {arch}: "
                              "every layer must be a mixture of experts (dense layers among "
                              "them are not built); import a model with mlp_only_layers []")
        step = data.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or step != 1 or not isinstance(step, int):
            raise ConfigError(f"{where}: decoder_sparse_step {step!r} is not supported for "
                              f"{arch}: only 1 (every layer a mixture of experts) is built")
    n = data.get("num_experts", data.get("num_local_experts"))
    if "num_local_experts" in data and data["num_local_experts"] != n:
        raise ConfigError(f"{where}: num_experts {n!r} and num_local_experts "
                          f"{data['num_local_experts']!r} disagree; keep one")
    defaults = MOE_DEFAULTS[family]
    width_key = "intermediate_size" if family == "olmoe" else "moe_intermediate_size"
    counts = {"num_experts": defaults["num_experts"] if n is None else n,
              "num_experts_per_tok": data.get("num_experts_per_tok", 8),
              width_key: data.get(width_key, defaults[width_key])}
    for key, value in counts.items():  # by the config.json key, before MoE names its field
        check_count(value, f"{where}: {key}")
    norm = data.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"{where}: norm_topk_prob must be true or false, got {described(norm)}")
    try:
        return MoE(n_experts=counts["num_experts"], top_k=counts["num_experts_per_tok"],
                   expert_ffn_dim=counts[width_key], norm_topk_prob=norm,
                   router_aux_loss_coef=data.get("router_aux_loss_coef",
                                                 defaults["router_aux_loss_coef"]),
                   router_z_loss_coef=data.get("router_z_loss_coef", 0.0))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc} ({arch})") from None


MOE_DEFAULTS = {
    "olmoe": {"num_experts": 64, "intermediate_size": 2048, "router_aux_loss_coef": 0.01},
    "qwen3_moe": {"num_experts": 128, "moe_intermediate_size": 768,
                  "router_aux_loss_coef": 0.001},
}
"""OlmoeConfig's and Qwen3MoeConfig's defaults for keys a config.json may leave out (both
default num_experts_per_tok 8, norm_topk_prob false and have no z-loss)."""


def moe_hf_dict(cfg: ModelConfig) -> dict:
    """OlmoeConfig's or Qwen3MoeConfig's fields for cfg.moe (DROP marks the dense keys their
    classes lack). output_router_logits is true when the coefficient is not 0, so a model
    loaded with from_pretrained adds the auxiliary loss as the reference trainer does;
    router_z_loss_coef (no transformers class reads it) is written only when not 0."""
    m = cfg.moe
    out = {"num_experts": m.n_experts, "num_experts_per_tok": m.top_k,
           "norm_topk_prob": m.norm_topk_prob, "router_aux_loss_coef": m.router_aux_loss_coef,
           "output_router_logits": m.router_aux_loss_coef > 0}
    if m.router_z_loss_coef:
        out["router_z_loss_coef"] = m.router_z_loss_coef
    if cfg.family == "olmoe":  # the expert width is intermediate_size; no head_dim key
        return {**out, "intermediate_size": m.expert_ffn_dim, "clip_qkv": None,
                "head_dim": DROP, "mlp_bias": DROP, "pretraining_tp": DROP}
    return {**out, "moe_intermediate_size": m.expert_ffn_dim, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
            "mlp_bias": DROP, "pretraining_tp": DROP}
