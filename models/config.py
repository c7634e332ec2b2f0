"""ModelConfig: the shape of a Llama-style decoder (RMSNorm, GQA attention with half-split RoPE,
optionally Llama 3.1-style RoPE frequency scaling, q/k/v biases (Qwen2) or a per-head RMSNorm of
q and k (Qwen3; over the whole projection for OLMoE), SwiGLU FFN or a mixture-of-experts FFN
in every layer (OLMoE, Qwen3-MoE: `MoE`), an untied head or one tied to the embedding) and the
zoo of named shapes shipped as JSON. Describes a transformer; never decides where it lives (that is memplan's
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


def described(value) -> str:
    """`value` for a message, with its JSON kind when that is what is wrong: "'64' (a string)",
    "64.0 (a float)", "true (true/false)", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (true/false)"
    kinds = {str: "a string", float: "a float", list: "a list", tuple: "a list", dict: "an object"}
    kind = kinds.get(type(value))
    return f"{value!r} ({kind})" if kind else repr(value)


def _written_as(value) -> str:
    """How to write `value` so that it is read as a whole number, when it plainly is one."""
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return f"; write {int(value)} without quotes"
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and value > 0:
        return f"; write {int(value)}"
    return ""


def check_count(value, what: str) -> int:
    """`value` if it is a positive whole number (not true/false, not 64.0, not '64'); else a
    ConfigError naming `what`, the value, its kind and how to write it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive whole number, got {described(value)}"
                          f"{_written_as(value)}")
    return value


def check_positive(value, what: str) -> float:
    """`value` as a float if it is a positive finite number (an int or a float, not true/false
    or a string); else a ConfigError naming `what` and the value."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        hint = "; write it without quotes" if isinstance(value, str) else ""
        raise ConfigError(f"{what} must be a positive finite number, got {described(value)}{hint}")
    return float(value)


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


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmoe", "qwen3_moe")
"""Families whose checkpoints train as themselves (docs/models.md lists what each refuses).
olmoe and qwen3_moe are mixture-of-experts families: they need ModelConfig.moe, and the
others refuse it; the engine trains them on the NumPy and CuPy backends (docs/moe.md)."""

MOE_FAMILIES = ("olmoe", "qwen3_moe")

FAMILY_ATTENTION = {"llama": (False, False), "mistral": (False, False),
                    "qwen2": (True, False), "qwen3": (False, True),
                    "olmoe": (False, True), "qwen3_moe": (False, True)}
"""family -> (attention_bias, qk_norm) its transformers class computes for the checkpoints we
import: Qwen2ForCausalLM always has q/k/v biases; Qwen3ForCausalLM always normalises q and k
(its attention_bias switch would bias o_proj too, which is refused on import); Llama's
attention_bias would also bias o_proj and Mistral has none. A family is the export's spelling,
so a config whose computation its family cannot express is refused. Qwen3-MoE's attention is
Qwen3's (per-head QK-norm); OLMoE's QK-norm runs over the whole q and k projections
(ModelConfig.qk_norm_whole), and its optional clip_qkv is not built (refused on import)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoE:
    """A mixture-of-experts feed-forward block in EVERY layer (transformers'
    OlmoeSparseMoeBlock, Qwen3MoeSparseMoeBlock): a router (N, D), softmax, top-k, optional
    renormalisation of the k weights, N routed SwiGLU experts of width expert_ffn_dim, dropless
    (no capacity factor), plus n_shared_experts ungated SwiGLU experts of the same width summed
    onto every token (DeepSeek-V3's shared_experts; 0 for OLMoE and Qwen3-MoE). Qwen3-MoE's
    dense layers (mlp_only_layers, decoder_sparse_step != 1) are not modelled: refused on
    import. The maths: dataflow.kernels.reference.moe, docs/moe.md."""

    n_experts: int
    """N: routed experts per layer (OLMoE-1B-7B 64, Qwen3-30B-A3B 128)."""
    top_k: int
    """k: experts each token is routed to (num_experts_per_tok)."""
    expert_ffn_dim: int
    """Hidden width of each expert (OLMoE: intermediate_size; Qwen3-MoE:
    moe_intermediate_size)."""
    norm_topk_prob: bool
    """Divide the k selected probabilities by their sum (Qwen3-MoE true, OLMoE false)."""
    router_aux_loss_coef: float
    """Coefficient of the load-balancing loss added to the mean cross-entropy (OLMoE 0.01,
    Qwen3-MoE 0.001); 0 trains without it."""
    router_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss (mean over all MoE layers' rows of logsumexp^2); 0 for
    both families, whose transformers classes have none."""
    n_shared_experts: int = 0

    def __post_init__(self) -> None:
        for field in ("n_experts", "top_k", "expert_ffn_dim"):
            check_count(getattr(self, field), f"moe {field}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"moe top_k {self.top_k} is more than n_experts "
                              f"{self.n_experts}; each token picks k distinct experts")
        n = self.n_shared_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"moe n_shared_experts must be a non-negative integer, got {n!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"moe norm_topk_prob must be true or false, got "
                              f"{self.norm_topk_prob!r}")
        for field in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ConfigError(f"moe {field} must be a non-negative finite number, got "
                                  f"{value!r} (0 trains without that loss)")


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
    pad_token_id: int | None = dataclasses.field(default=None,
                                                 metadata={"omit_if_default": True})
    """transformers builds every supported family's embedding as nn.Embedding(padding_idx =
    config.pad_token_id): the lookup adds no gradient to that row, so training never moves it
    (a tied head's gradient still reaches it). OLMoE's config sets 1 (its default when
    config.json omits it); the others none. Left out of the JSON when None."""
    moe: MoE | None = dataclasses.field(default=None, metadata={"omit_if_default": True})
    """Every layer's FFN is this mixture of experts (families olmoe, qwen3_moe, which need it;
    the others refuse it); ffn_dim then holds transformers' dense intermediate_size, which no
    layer uses (Qwen3-30B-A3B: 6144; OLMoE: the expert width) and which nothing counts. The
    engine trains it on the NumPy and CuPy backends (every expert moves with its layer's block),
    on one device, as replicas and on rings (the ranks pass each round's routing totals:
    dataflow.memplan.step.ring_compile); an op table without MoE ops refuses it by name
    (dataflow.engine.refuse_moe_backend).
    Left out of the JSON when None, so configs, checkpoints and plan hashes without it are
    unchanged."""
    head_vocab_rows: int = dataclasses.field(default=0, metadata={"omit_if_default": True})
    """Rows of the lm_head this model's head holds; 0: all vocab_size. Only the model a
    vocabulary-parallel ring rank plans sets it (dataflow.memplan.plan.ranks.rank_model: the
    rank's shard of the vocabulary); its embedding keeps vocab_size rows. Left out of the JSON
    when 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"model name must be a non-empty string, got {described(self.name)}")
        for field in ("vocab_size", "model_dim", "head_dim", "n_layers", "n_heads",
                      "n_kv_heads", "ffn_dim"):
            check_count(getattr(self, field), f"model '{self.name}': {field}")
        for field in ("rope_theta", "norm_eps"):
            check_positive(getattr(self, field), f"model '{self.name}': {field}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model '{self.name}': n_heads {self.n_heads} is not a multiple "
                              f"of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model '{self.name}': head_dim {self.head_dim} must be even "
                              "for RoPE")
        if self.family not in FAMILIES:
            raise ConfigError(f"model '{self.name}': family {self.family!r} is not one of "
                              f"{', '.join(FAMILIES)}")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)
                                or not 0 <= pad < self.vocab_size):
            raise ConfigError(f"model '{self.name}': pad_token_id {pad!r} is not a token id "
                              f"in 0..{self.vocab_size - 1} (or null: no padding row)")
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
        if self.moe is not None and not isinstance(self.moe, MoE):
            raise ConfigError(f"model '{self.name}': moe must be a MoE or None, got "
                              f"{self.moe!r}")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ConfigError(
                f"model '{self.name}': family {self.family!r} "
                + (f"has a mixture-of-experts FFN: give it a moe description"
                   if self.moe is None else
                   f"has a dense FFN, not moe; mixture-of-experts families are "
                   f"{', '.join(MOE_FAMILIES)}"))
        rows = self.head_vocab_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= self.vocab_size \
                or (rows and self.tie_embeddings):
            raise ConfigError(f"model '{self.name}': head_vocab_rows {rows!r} must be a whole "
                              f"number in 0..{self.vocab_size} (0: the whole vocabulary), and 0 "
                              "for a tied head")
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
    def qk_norm_whole(self) -> bool:
        """QK-norm over the whole q and k projections (weights (q_dim,), (kv_dim,)), OLMoE's,
        rather than per head over head_dim (Qwen3's)."""
        return self.qk_norm and self.family == "olmoe"

    @property
    def qk_norm_dims(self) -> tuple[int, int]:
        """Lengths of the q_norm and k_norm weights (with qk_norm)."""
        if self.qk_norm_whole:
            return self.q_dim, self.kv_dim
        return self.head_dim, self.head_dim

    def _attn_params(self) -> int:
        d = self.model_dim
        extra = ((self.q_dim + 2 * self.kv_dim) * self.attention_bias
                 + sum(self.qk_norm_dims) * self.qk_norm)
        return 2 * d + d * self.q_dim * 2 + d * self.kv_dim * 2 + extra

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (weights, norms, biases and QK-norm weights;
        with moe the router and every expert, routed and shared)."""
        d = self.model_dim
        if self.moe is None:
            return self._attn_params() + 3 * d * self.ffn_dim
        m = self.moe
        return (self._attn_params() + m.n_experts * d
                + (m.n_experts + m.n_shared_experts) * 3 * d * m.expert_ffn_dim)

    @property
    def active_layer_params(self) -> int:
        """Parameters one token uses in one layer: layer_params for a dense model; with moe
        the router, top_k routed experts and the shared ones (MFU counts these)."""
        if self.moe is None:
            return self.layer_params
        m, d = self.moe, self.model_dim
        return (self._attn_params() + m.n_experts * d
                + (m.top_k + m.n_shared_experts) * 3 * d * m.expert_ffn_dim)

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.model_dim

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection when it is untied (a tied head's projection
        is the embedding, counted once, in embed_params)."""
        return self.model_dim + (0 if self.tie_embeddings else self.head_rows * self.model_dim)

    @property
    def head_rows(self) -> int:
        """Rows of the lm_head this model's head holds: vocab_size, or a vocabulary-parallel
        ring rank's shard (head_vocab_rows)."""
        return self.head_vocab_rows or self.vocab_size

    @property
    def n_params(self) -> int:
        """Every parameter (with moe: all experts)."""
        return self.embed_params + self.n_layers * self.layer_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses (n_params for a dense model; with moe: top_k experts)."""
        return self.embed_params + self.n_layers * self.active_layer_params + self.head_params

    def to_json(self) -> str:
        return to_json(self)


def zoo_names() -> list[str]:
    """Names of the shipped model configs, small first (names of one size alphabetically)."""
    names = [p.name[:-5] for p in resources.files("dataflow.models.zoo").iterdir()
             if p.name.endswith(".json")]
    order = {"tiny": 0, "small": 1}
    return sorted(names, key=lambda n: (order.get(n, 2), _size_key(n), n))


def _size_key(name: str) -> float:
    """Billions of parameters the name ends with ('8b', 'mistral-7b', 'olmoe-1b-7b'; an MoE's
    total before its active size: 'qwen3-30b-a3b' is 30); unnamed sizes last."""
    import re

    m = re.search(r"(\d+(?:\.\d+)?)b(?:-a\d+(?:\.\d+)?b)?$", name)
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
