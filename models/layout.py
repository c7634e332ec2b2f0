"""Block layouts: where each tensor sits inside the one contiguous bf16 buffer of a layer (and of
the embedding and the head). Grads, AdamW m and v share the layout, so a layer moves in one copy
per direction. Pure offsets: views are made by slicing whatever 1-D array the caller holds
(NumPy or CuPy), so this module never imports array libraries."""

from __future__ import annotations

import dataclasses
import enum

from dataflow.models.config import ModelConfig

ALIGN_ELEMS = 128
"""Every tensor starts on a 256-byte boundary (128 bf16), so GPU kernels can load 16 bytes at a
time from any tensor of a block and cuBLAS sees aligned pointers."""

BF16_BYTES = 2


class BlockKind(enum.Enum):
    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSlot:
    name: str
    """Name relative to its block, in transformers' spelling ('self_attn.q_proj')."""
    shape: tuple[int, ...]
    """transformers' shape: linear weights are [out_features, in_features]."""
    offset: int
    """First element inside the block."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BlockLayout:
    kind: BlockKind
    tensors: tuple[TensorSlot, ...]
    numel: int
    """Elements in the block including alignment padding."""

    @property
    def nbytes(self) -> int:
        return self.numel * BF16_BYTES

    def slot(self, name: str) -> TensorSlot:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor '{name}' in the {self.kind.value} block; "
                       f"it holds {[t.name for t in self.tensors]}")

    def view(self, block, name: str):
        """The tensor `name` as a view into `block`, a 1-D array of this block's elements."""
        t = self.slot(name)
        return block[t.offset:t.offset + t.numel].reshape(t.shape)

    def views(self, block) -> dict:
        return {t.name: self.view(block, t.name) for t in self.tensors}

    def full_name(self, name: str, layer: int | None = None) -> str:
        """transformers' state_dict key for a tensor of this block ('self_attn.q_proj.bias'
        keeps its suffix; every other name gets '.weight')."""
        if self.kind is BlockKind.LAYER:
            if name.endswith(".bias"):
                return f"model.layers.{layer}.{name}"
            return f"model.layers.{layer}.{name}.weight"
        if self.kind is BlockKind.EMBED:
            return f"model.{name}.weight"
        return f"model.{name}.weight" if name == "norm" else f"{name}.weight"


def _pack(kind: BlockKind, named_shapes: list[tuple[str, tuple[int, ...]]]) -> BlockLayout:
    tensors, offset = [], 0
    for name, shape in named_shapes:
        tensors.append(TensorSlot(name=name, shape=shape, offset=offset))
        n = 1
        for s in shape:
            n *= s
        offset += -(-n // ALIGN_ELEMS) * ALIGN_ELEMS
    return BlockLayout(kind=kind, tensors=tuple(tensors), numel=offset)


LAYER_TENSORS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
BIAS_TENSORS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
"""With ModelConfig.attention_bias (Qwen2): (q_dim,), (kv_dim,), (kv_dim,), after the weights."""
QK_NORM_TENSORS = ("self_attn.q_norm", "self_attn.k_norm")
"""With ModelConfig.qk_norm (Qwen3): two (head_dim,) RMSNorm weights, after the weights; OLMoE's
(qk_norm_whole) are (q_dim,) and (kv_dim,)."""
NORM_TENSORS = frozenset({"input_layernorm", "post_attention_layernorm", "norm",
                          *QK_NORM_TENSORS})
ROUTER_TENSOR = "mlp.gate"
"""With ModelConfig.moe: the router (n_experts, D), transformers' `mlp.gate.weight`."""
EXPERT_TENSORS = ("gate_proj", "up_proj", "down_proj")
"""Each expert's three matrices, contiguous: (F_e, D), (F_e, D), (D, F_e)."""


def expert_names(e: int, *, shared: bool = False) -> tuple[str, str, str]:
    """Block names of routed expert e's (or shared expert e's) gate, up and down:
    'mlp.experts.{e}.gate_proj' as transformers' released checkpoints name them (shared:
    'mlp.shared_experts.{e}.gate_proj')."""
    group = "shared_experts" if shared else "experts"
    return tuple(f"mlp.{group}.{e}.{t}" for t in EXPERT_TENSORS)


def layer_layout(cfg: ModelConfig) -> BlockLayout:
    """The nine Llama tensors in LAYER_TENSORS order, then the family's extra vectors (biases,
    QK-norm weights) at the end, so a Llama block's offsets do not depend on them.

    With cfg.moe the three mlp tensors are replaced, after post_attention_layernorm, by the
    router (N, D), then each routed expert's gate, up and down contiguous (expert 0's three,
    expert 1's, ...: one expert is one contiguous range, docs/moe.md), then the shared experts
    likewise; the family's extra vectors still come last."""
    d, q, kv, f = cfg.model_dim, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    if cfg.moe is None:
        shapes = [(d,), (q, d), (kv, d), (kv, d), (d, q), (d,), (f, d), (f, d), (d, f)]
        named = list(zip(LAYER_TENSORS, shapes))
    else:
        m, fe = cfg.moe, cfg.moe.expert_ffn_dim
        named = list(zip(LAYER_TENSORS[:6], [(d,), (q, d), (kv, d), (kv, d), (d, q), (d,)]))
        named.append((ROUTER_TENSOR, (m.n_experts, d)))
        for shared, count in ((False, m.n_experts), (True, m.n_shared_experts)):
            for e in range(count):
                named += list(zip(expert_names(e, shared=shared), [(fe, d), (fe, d), (d, fe)]))
    if cfg.attention_bias:
        named += list(zip(BIAS_TENSORS, [(q,), (kv,), (kv,)]))
    if cfg.qk_norm:
        named += [(n, (dim,)) for n, dim in zip(QK_NORM_TENSORS, cfg.qk_norm_dims)]
    return _pack(BlockKind.LAYER, named)


def embed_layout(cfg: ModelConfig) -> BlockLayout:
    return _pack(BlockKind.EMBED, [("embed_tokens", (cfg.vocab_size, cfg.model_dim))])


def head_layout(cfg: ModelConfig) -> BlockLayout:
    """The final norm and lm_head (V, D); with cfg.tie_embeddings the norm alone: the head's
    projection is the embedding block's table, stored, updated and saved once there (the
    executor's head reads that table and accumulates its gradient into the embedding's)."""
    if cfg.tie_embeddings:
        return _pack(BlockKind.HEAD, [("norm", (cfg.model_dim,))])
    return _pack(BlockKind.HEAD, [("norm", (cfg.model_dim,)),
                                  ("lm_head", (cfg.head_rows, cfg.model_dim))])
