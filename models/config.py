"""ModelConfig: the shape of a Llama-style decoder (RMSNorm, GQA attention with half-split RoPE,
optionally Llama 3.1-style RoPE frequency scaling, q/k/v biases (Qwen2) or a per-head RMSNorm of
q and k (Qwen3), SwiGLU FFN, an untied head or one tied to the embedding) and the zoo of named
shapes shipped as JSON. Describes a transformer; never decides where it lives (that is memplan's
job) and never imports array libraries."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from importlib import resources
from pathlib import Path

from dataflow.models.errors import ConfigError
from dataflow.models.serial import from_dict, to_json


class RopeType(enum.Enum):
    """RoPE frequency scalings our kernels compute exactly as transformers does. Plain RoPE
    (transformers' rope_type 'default') is `rope_scaling = None`, not a member."""

    LLAMA3 = "llama3"
    """Llama 3.1 / 3.2: transformers' `_compute_llama3_parameters`."""


SUPPORTED_ROPE_TYPES = tuple(t.value for t in RopeType)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """transformers' `rope_scaling` of a Llama 3.1/3.2 config.json, field for field. Inverse
    frequencies with wavelength 2 pi / f above original_max_position_embeddings / low_freq_factor
    are divided by `factor`, those below original_max_position_embeddings / high_freq_factor are
    kept, and those between are interpolated smoothly (dataflow.kernels.reference.rope.rope_inv_freq)."""

    rope_type: RopeType = RopeType.LLAMA3
    factor: float
    """Divisor of the low frequencies: 8 for Llama 3.1, 32 for Llama 3.2 1B/3B."""
    low_freq_factor: float
    """1 for Llama 3.1/3.2."""
    high_freq_factor: float
    """4 for Llama 3.1/3.2; greater than low_freq_factor."""
    original_max_position_embeddings: int
    """Context length of pretraining before the extension: 8192 for Llama 3.1/3.2."""

    def __post_init__(self) -> None:
        if not isinstance(self.rope_type, RopeType):
            if self.rope_type in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"rope_scaling rope_type must be RopeType("
                                  f"{self.rope_type!r}), not the string")
            raise ConfigError(f"rope_scaling rope_type {self.rope_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (or no rope_scaling "
                              "for plain RoPE)")
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"rope_scaling {field} must be a positive finite number, got "
                                  f"{value!r} (Llama 3.1: factor 8, low_freq_factor 1, "
                                  "high_freq_factor 4)")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(f"rope_scaling high_freq_factor {self.high_freq_factor!r} must be "
                              f"greater than low_freq_factor {self.low_freq_factor!r} (Llama 3.1: "
                              "4 and 1)")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError("rope_scaling original_max_position_embeddings must be a positive "
                              f"integer, got {value!r} (Llama 3.1: 8192)")


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Families whose checkpoints train as themselves (docs/models.md lists what each refuses)."""

FAMILY_ATTENTION = {"llama": (False, False), "mistral": (False, False),
                    "qwen2": (True, False), "qwen3": (False, True)}
"""family -> (attention_bias, qk_norm) its transformers class computes for the checkpoints we
import: Qwen2ForCausalLM always has q/k/v biases; Qwen3ForCausalLM always normalises q and k
(its attention_bias switch would bias o_proj too, which is refused on import); Llama's
attention_bias would also bias o_proj and Mistral has none. A family is the export's spelling,
so a config whose computation its family cannot express is refused."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    name: str
    """Zoo name or a user's label; only used in messages and records."""
    vocab_size: int
    """V: rows of the embedding and of the head."""
    model_dim: int
    """D: width of the residual stream."""
    head_dim: int
    """E: width of one attention head."""
    n_layers: int
    n_heads: int
    """H: query heads."""
    n_kv_heads: int
    """K: key/value heads (grouped-query attention; H is a multiple of K)."""
    ffn_dim: int
    """F: hidden width of the SwiGLU FFN."""
    rope_theta: float
    norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = dataclasses.field(default=None,
                                                         metadata={"omit_if_default": True})
    """None: plain RoPE, inverse frequencies rope_theta ** (-2j/E). Left out of the JSON when
    None, so configs (and plan hashes) written before this field existed are unchanged."""
    family: str = dataclasses.field(default="llama", metadata={"omit_if_default": True})
    """The transformers family the model came from and is exported to: 'llama'
    (LlamaForCausalLM) or 'mistral' (MistralForCausalLM: the same computation, its own
    config.json spelling). Left out of the JSON when 'llama'."""
    sliding_window: int | None = dataclasses.field(default=None,
                                                   metadata={"omit_if_default": True})
    """Tokens a query attends back (Mistral's sliding_window); None: the whole sequence. The
    kernels compute full causal attention, so a sequence longer than the window is refused
    (memplan.search.make_plan) rather than trained as another model."""
    attention_bias: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """q, k and v projections add a bias vector (q_dim, kv_dim, kv_dim); o has none. Qwen2's
    attention (Qwen2ForCausalLM). Left out of the JSON when False."""
    qk_norm: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """Each head's q and k go through an RMSNorm over head_dim (one weight vector of E for all
    query heads, one for all kv heads, norm_eps) after the projection and before RoPE: Qwen3's
    attention (Qwen3ForCausalLM). Left out of the JSON when False."""
    tie_embeddings: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """The output projection is the embedding table itself (transformers'
    tie_word_embeddings: Llama 3.2 1B/3B, Qwen2.5 0.5B-3B, SmolLM2): one (V, D) parameter,
    stored once, with one AdamW state, its gradient the sum of the embedding lookup's and the
    head matmul's. The embedding block holds it and the head block then holds the final norm
    only (dataflow.models.layout.head_layout); the planner keeps that block resident on the
    device and a ring of 2+ ranks is refused (docs/models.md). Left out of the JSON when
    False, so configs, checkpoints and plan hashes without it are unchanged."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "model_dim", "head_dim", "n_layers", "n_heads",
                      "n_kv_heads", "ffn_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model '{self.name}': {field} must be a positive integer, "
                                  f"got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model '{self.name}': n_heads {self.n_heads} is not a multiple "
                              f"of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model '{self.name}': head_dim {self.head_dim} must be even "
                              "for RoPE")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError(f"model '{self.name}': rope_theta and norm_eps must be positive, "
                              f"got {self.rope_theta!r} and {self.norm_eps!r}")
        if self.family not in FAMILIES:
            raise ConfigError(f"model '{self.name}': family {self.family!r} is not one of "
                              f"{', '.join(FAMILIES)}")
        for field in ("attention_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"model '{self.name}': {field} must be true or false, got "
                                  f"{getattr(self, field)!r}")
        want = FAMILY_ATTENTION[self.family]
        if (self.attention_bias, self.qk_norm) != want:
            fits = [f for f, a in FAMILY_ATTENTION.items()
                    if a == (self.attention_bias, self.qk_norm)]
            raise ConfigError(f"model '{self.name}': family {self.family!r} computes "
                              f"attention_bias={want[0]}, qk_norm={want[1]}, not "
                              f"attention_bias={self.attention_bias}, qk_norm={self.qk_norm}; "
                              f"use those values, or family "
                              f"{' or '.join(repr(f) for f in fits) or '(none has both)'}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or
                                                not isinstance(self.sliding_window, int) or
                                                self.sliding_window <= 0):
            raise ConfigError(f"model '{self.name}': sliding_window must be a positive integer "
                              f"or None, got {self.sliding_window!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"model '{self.name}': rope_scaling must be a RopeScaling or None, "
                              f"got {self.rope_scaling!r}")

    @property
    def q_dim(self) -> int:
        """H*E: width of the query projection's output (equals D for every zoo model)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """K*E: width of the key and of the value projection's output."""
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (weights, norms, biases and QK-norm weights)."""
        d = self.model_dim
        extra = ((self.q_dim + 2 * self.kv_dim) * self.attention_bias
                 + 2 * self.head_dim * self.qk_norm)
        return 2 * d + d * self.q_dim * 2 + d * self.kv_dim * 2 + 3 * d * self.ffn_dim + extra

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.model_dim

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection when it is untied (a tied head's projection
        is the embedding, counted once, in embed_params)."""
        return self.model_dim + (0 if self.tie_embeddings else self.vocab_size * self.model_dim)

    @property
    def n_params(self) -> int:
        return self.embed_params + self.n_layers * self.layer_params + self.head_params

    def to_json(self) -> str:
        return to_json(self)


def zoo_names() -> list[str]:
    """Names of the shipped model configs, small first (names of one size alphabetically)."""
    names = [p.name[:-5] for p in resources.files("dataflow.models.zoo").iterdir()
             if p.name.endswith(".json")]
    order = {"tiny": 0, "small": 1}
    return sorted(names, key=lambda n: (order.get(n, 2), _size_key(n), n))


def _size_key(name: str) -> float:
    """Billions of parameters the name ends with ('8b', 'mistral-7b'); unnamed sizes last."""
    import re

    m = re.search(r"(\d+(?:\.\d+)?)b$", name)
    return float(m.group(1)) if m else float("inf")


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A zoo name ('tiny', '8b', ...), a config JSON file, or a saved model directory."""
    text = str(name_or_path)
    if text in zoo_names():
        data = json.loads(resources.files("dataflow.models.zoo").joinpath(f"{text}.json").read_text())
        return from_dict(ModelConfig, data, where=f"zoo model '{text}'")
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config {path} is not valid JSON ({exc})") from None
        return from_dict(ModelConfig, data, where=str(path))
    raise ConfigError(f"unknown model '{text}'; known: {', '.join(zoo_names())}, "
                      "or a path to a saved model directory or config JSON")
