"""A Hugging Face config.json (transformers' LlamaConfig, MistralConfig, Qwen2Config,
Qwen3Config, OlmoeConfig, Qwen3MoeConfig) read into a ModelConfig, and `model_config`: the one
resolution of a model argument that every command and the Engine share (a zoo name, a config
JSON, a saved model or checkpoint step directory, or a Hugging Face directory). Every value is
checked by type before use: a string, float or true/false where a count belongs is refused by
key, never converted. Reads JSON only: never imports array libraries (dataflow-plan resolves
its model through here) and never opens the weights (models.hf does)."""

from __future__ import annotations

import json
from pathlib import Path

from dataflow.models.config import (FAMILY_ATTENTION, MOE_FAMILIES, SUPPORTED_ROPE_TYPES,
                                    ModelConfig, RopeScaling, RopeType, check_count,
                                    check_positive, described, load_config, zoo_names)
from dataflow.models.errors import ConfigError
from dataflow.models.hf_moe import moe_from_hf

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def is_hf_dir(path) -> bool:
    """True for a directory holding a transformers config.json and safetensors weights."""
    p = Path(str(path))
    if not (p.is_dir() and (p / "config.json").is_file()):
        return False
    if not ((p / INDEX).is_file() or (p / SINGLE).is_file()):
        return False
    try:
        data = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


FAMILY_PAD_TOKEN = {"olmoe": 1}
"""transformers' pad_token_id where config.json leaves it out (OlmoeConfig's default; the other
families' is None): the embedding row it never trains (ModelConfig.pad_token_id)."""

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""model_type -> the transformers class whose computation our kernels reproduce (docs/moe.md
for the MoE families)."""

NOT_YET = {
    "qwen2_moe": "Qwen2-MoE's sigmoid-gated shared expert is not built",
    "mixtral": ("Mixtral's mixture-of-experts layout (block_sparse_moe, w1/w2/w3) is not built "
                "yet; the engine's MoE block trains OLMoE and Qwen3-MoE"),
    "gemma": "Gemma's GeLU FFN, scaled embedding and (1 + w) norms are not built",
    "gemma2": "Gemma 2's soft-capping and alternating sliding windows are not built",
    "phi3": "Phi-3's fused qkv / gate_up projections are not imported yet",
}
"""Families refused by name, with what is missing."""


def _window(data: dict, where) -> int | None:
    """Mistral's sliding_window: None (or absent) attends over the whole sequence."""
    w = data.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise ConfigError(f"{where}: sliding_window {w!r} is not a positive integer or null")
    return w


def _read_json(where: Path) -> dict:
    """The JSON object in `where`, or a ConfigError saying what the file holds instead."""
    try:
        data = json.loads(where.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); a Hugging Face config.json is "
                          "one JSON object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds {described(data)}, not a JSON object of config keys")
    return data


def _count(data: dict, key: str, where, default=None) -> int:
    """data[key] as a positive whole number (`default` when the key is absent or null)."""
    value = data.get(key)
    if value is None and default is not None:
        return default
    if key not in data:
        raise ConfigError(f"{where} has no {key!r}; a {'/'.join(ARCHITECTURES.values())} "
                          "config needs vocab_size, hidden_size, intermediate_size, "
                          "num_hidden_layers, num_attention_heads")
    return check_count(value, f"{where}: {key}")


def _shape(data: dict, family: str, where) -> dict:
    """ModelConfig's size fields from the family's keys, each checked by type and sign, with
    hidden_size // num_attention_heads as the head width where head_dim is absent."""
    dim = _count(data, "hidden_size", where)
    heads = _count(data, "num_attention_heads", where)
    if data.get("head_dim") is None and dim % heads:
        raise ConfigError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads "
                          f"{heads}, and there is no head_dim to give the head width; use a "
                          f"head count that divides {dim}, or give head_dim")
    head_dim = _count(data, "head_dim", where, default=dim // heads)
    if family == "olmoe" and head_dim * heads != dim:  # OlmoeAttention has no head_dim
        raise ConfigError(f"{where}: head_dim {head_dim} is not hidden_size // "
                          f"num_attention_heads = {dim // heads}, which OlmoeForCausalLM "
                          "uses; drop head_dim")
    kv_heads = _count(data, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}; grouped-query attention needs "
                          f"a divisor of {heads}")
    return {"vocab_size": _count(data, "vocab_size", where), "model_dim": dim,
            "head_dim": head_dim, "n_layers": _count(data, "num_hidden_layers", where),
            "n_heads": heads, "n_kv_heads": kv_heads,
            "ffn_dim": _count(data, "intermediate_size", where),
            "norm_eps": check_positive(data.get("rms_norm_eps", 1e-6), f"{where}: rms_norm_eps")}


def _switches(data: dict, family: str, where) -> None:
    """Refuse the switches our kernels do not compute (activation, biases, sliding layers)."""
    checks = {"hidden_act": ("silu", data.get("hidden_act", "silu")),
              "mlp_bias": (False, data.get("mlp_bias", False))}
    if family != "qwen2":  # Qwen2's q/k/v biases are not a switch; Llama's and Qwen3's would
        # bias o_proj as well, which is not built
        checks["attention_bias"] = (False, data.get("attention_bias", False))
    if family in ("qwen2", "qwen3", "qwen3_moe"):  # sliding layers from max_window_layers on
        checks["use_sliding_window"] = (False, data.get("use_sliding_window", False))
    layer_types = data.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ConfigError(f"{where}: layer_types must be a list of strings, got "
                          f"{described(layer_types)}")
    if any(t != "full_attention" for t in layer_types):  # transformers 5 spells windows so too
        raise ConfigError(f"{where}: layer_types {sorted(set(layer_types))} are not supported "
                          f"for {ARCHITECTURES[family]}: only full_attention layers are built "
                          "(the kernels compute full causal attention)")
    for key, (want, got) in checks.items():
        if type(got) is not type(want) or got != want:
            raise ConfigError(f"{where}: {key} = {got!r} is not supported for "
                              f"{ARCHITECTURES[family]} (our kernels implement {key} = "
                              f"{want!r}); import a model without it")


def hf_config(path: str | Path, *, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama, Mistral, Qwen2, Qwen3, OLMoE or Qwen3-MoE
    directory (the family from its model_type, with Qwen2's q/k/v biases, the QK-norm of Qwen3
    and both MoE families, the MoE block of OlmoeConfig / Qwen3MoeConfig); refuses what our
    kernels would not compute exactly as transformers does, and every value of the wrong type
    or sign, by key."""
    path = Path(path)
    where = path / "config.json"
    data = _read_json(where)
    family = data.get("model_type")
    if not isinstance(family, str) or family not in ARCHITECTURES:
        why = NOT_YET.get(family, "its computation is not built") if isinstance(family, str) \
            else "model_type must be a string"
        raise ConfigError(f"{where}: model_type {family!r} is not supported ({why}); "
                          f"supported: {', '.join(repr(f) for f in ARCHITECTURES)} "
                          f"({', '.join(ARCHITECTURES.values())})")
    _switches(data, family, where)
    shape = _shape(data, family, where)
    rope_theta, rope_scaling = _hf_rope(data, where)
    tied = data.get("tie_word_embeddings", False)  # every supported family defaults to False
    if not isinstance(tied, bool):
        raise ConfigError(f"{where}: tie_word_embeddings {tied!r} is not true or false")
    pad = data.get("pad_token_id", FAMILY_PAD_TOKEN.get(family))
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)
                            or not 0 <= pad < shape["vocab_size"]):
        raise ConfigError(f"{where}: pad_token_id must be a token id in "
                          f"0..{shape['vocab_size'] - 1} or null, got {described(pad)}")
    moe = (moe_from_hf(data, family, ARCHITECTURES[family], where) if family in MOE_FAMILIES
           else None)
    try:
        return ModelConfig(
            name=name or path.resolve().name, **shape,
            rope_theta=rope_theta, rope_scaling=rope_scaling, family=family,
            sliding_window=_window(data, where) if family == "mistral" else None,
            attention_bias=FAMILY_ATTENTION[family][0], qk_norm=FAMILY_ATTENTION[family][1],
            tie_embeddings=tied, moe=moe, pad_token_id=pad)
    except ConfigError as exc:  # e.g. an odd head_dim: say which file it came from
        raise ConfigError(f"{where}: {exc}") from None


def _hf_rope(data: dict, where) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of a LlamaConfig dict: `rope_theta` plus `rope_scaling` as
    transformers 4.x writes them, or transformers 5's `rope_parameters` (theta inside). Plain
    RoPE ('default' or no scaling) gives None; 'llama3' a RopeScaling; any other type, or a
    'llama3' entry with missing or unknown keys, is refused naming it."""
    theta = data.get("rope_theta")
    scaling = data.get("rope_scaling")
    params = data.get("rope_parameters")
    if scaling is None and isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        inner = params.get("rope_theta")
        if theta is not None and inner is not None and inner != theta:
            raise ConfigError(f"{where}: rope_theta {theta!r} and rope_parameters.rope_theta "
                              f"{inner!r} disagree; keep one")
        theta = inner if theta is None else theta
    theta = 10000.0 if theta is None else theta
    theta = check_positive(theta, f"{where}: rope_theta")
    if scaling is None:
        return float(theta), None
    supported = (f"supported: {', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)} (Llama 3.1/3.2) "
                 "or none/'default' (plain RoPE theta ** (-2j/E))")
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling {scaling!r} is not a JSON object; {supported}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    if rope_type == "default":
        if rest:
            raise ConfigError(f"{where}: rope_scaling of rope_type 'default' (plain RoPE) takes "
                              f"no parameters, got {sorted(rest)}")
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope_scaling rope_type {rope_type!r} is not supported; "
                          f"{supported}")
    missing = [k for k in _LLAMA3_KEYS if k not in rest]
    unknown = sorted(k for k in rest if k not in _LLAMA3_KEYS)
    if missing or unknown:
        raise ConfigError(f"{where}: rope_scaling of rope_type {rope_type!r} needs exactly "
                          f"{', '.join(_LLAMA3_KEYS)}; missing {missing}, unknown {unknown}")
    values = {k: rest[k] for k in _LLAMA3_KEYS}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: rope_scaling {k} {v!r} is not a number")
    orig = values["original_max_position_embeddings"]
    if orig != int(orig):
        raise ConfigError(f"{where}: rope_scaling original_max_position_embeddings {orig!r} is "
                          "not an integer")
    try:
        return float(theta), RopeScaling(
            rope_type=RopeType(rope_type), factor=float(values["factor"]),
            low_freq_factor=float(values["low_freq_factor"]),
            high_freq_factor=float(values["high_freq_factor"]),
            original_max_position_embeddings=int(orig))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


MODEL_FORMS = ("a zoo name, a saved model or checkpoint step directory, a model config JSON, or "
               "a Hugging Face directory of a Llama, Mistral, Qwen2, Qwen3, OLMoE or Qwen3-MoE "
               "model (config.json with model.safetensors)")
"""What model_config accepts, for the commands' --help."""


def model_config(name_or_path) -> ModelConfig:
    """The ModelConfig a model argument names, read the same way by every command and the
    Engine: a zoo name, a model config JSON file, a saved model or checkpoint step directory
    (config.json in our format) or a Hugging Face directory (config.json with
    model.safetensors or its index). Anything else is refused in one line naming what was
    found there and what would work."""
    if is_hf_dir(name_or_path):
        return hf_config(name_or_path)
    text = str(name_or_path)
    if text in zoo_names():
        return load_config(text)
    would_work = (f"a saved model or checkpoint step directory, a model config JSON, or a "
                  f"Hugging Face directory of a {', '.join(ARCHITECTURES.values())} "
                  f"(config.json with {SINGLE} or {INDEX})")
    if not Path(text).exists():
        raise ConfigError(f"unknown model '{text}'; known: {', '.join(zoo_names())}, or "
                          f"{would_work}; there is no file or directory '{text}'")
    found = _not_a_model(Path(text), text)
    if found:
        raise ConfigError(f"{found}; pass a zoo name ({', '.join(zoo_names())}), {would_work}")
    return load_config(text)


def _not_a_model(path: Path, text: str) -> str | None:
    """What is at `path` when it is no model (None when load_config should read it)."""
    config = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config.is_file():
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        if any(n.startswith("step_") for n in names):
            return (f"{text} is a checkpoint root (it holds {', '.join(names[:4])}) rather than "
                    "a model; pass one of its step_* directories")
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "nothing"
        return f"{text} is a directory without config.json (it holds {shown})"
    if not config.is_file():
        return f"{text} is neither a directory nor a file"
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # load_config names the JSON error
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        if path.is_dir():
            return (f"{text} holds a Hugging Face config.json but no weights ({SINGLE} or "
                    f"{INDEX})")
        return (f"{text} is a Hugging Face config.json: pass the directory that holds it with "
                f"its {SINGLE}")
    return None
