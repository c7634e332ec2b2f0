"""ModelConfig: the shape of a Llama-style decoder (RMSNorm, GQA attention with half-split RoPE,
SwiGLU FFN, untied head) and the zoo of named shapes shipped as JSON. Describes a transformer;
never decides where it lives (that is memplan's job) and never imports array libraries."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from models.errors import ConfigError
from models.serial import from_dict, to_json


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
        """Parameters of one transformer layer (weights and norms)."""
        d = self.model_dim
        return 2 * d + d * self.q_dim * 2 + d * self.kv_dim * 2 + 3 * d * self.ffn_dim

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.model_dim

    @property
    def head_params(self) -> int:
        """Final norm plus the untied output projection."""
        return self.model_dim + self.vocab_size * self.model_dim

    @property
    def n_params(self) -> int:
        return self.embed_params + self.n_layers * self.layer_params + self.head_params

    def to_json(self) -> str:
        return to_json(self)


def zoo_names() -> list[str]:
    """Names of the shipped model configs, small first."""
    names = [p.name[:-5] for p in resources.files("models.zoo").iterdir()
             if p.name.endswith(".json")]
    order = {"tiny": 0, "small": 1}
    return sorted(names, key=lambda n: (order.get(n, 2), _size_key(n)))


def _size_key(name: str) -> float:
    try:
        return float(name.rstrip("b"))
    except ValueError:
        return float("inf")


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A zoo name ('tiny', '8b', ...), a config JSON file, or a saved model directory."""
    text = str(name_or_path)
    if text in zoo_names():
        data = json.loads(resources.files("models.zoo").joinpath(f"{text}.json").read_text())
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
