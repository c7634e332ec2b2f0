"""Deterministic, seeded initialisation of a model's blocks in bf16, written straight into the
caller's 1-D block buffers (numba, parallel, counter-based RNG so the bytes do not depend on the
thread count). Never allocates a full fp32 copy of a block, never touches a device, and never
decides where a block lives: the caller passes `out=` to fill arena or pinned memory.

Rules are PyTorch's default nn.Linear / nn.Embedding init (transformers' own `_init_weights`
would use normal(0, initializer_range=0.02) instead): RMSNorm weights (QK-norm's too) are 1.0;
linear weights (q, k, v, o, gate, up, down projections and lm_head) are uniform in [-b, b] with
b = 1/sqrt(fan_in), fan_in = in_features = shape[1], and so are the q/k/v biases (fan_in of
their projection, as nn.Linear's bias); the embedding is normal with std
EMBED_STD = 1.0 (the first input_layernorm rescales it, so its scale cannot blow up layer 0),
except a tied one (ModelConfig.tie_embeddings), which is lm_head's uniform ±1/sqrt(D).
Element n of tensor t of a block is a pure function of (seed, block kind, layer, t, n): splitmix64
of a per-tensor key plus the counter n (the pair n // 2 for the embedding's Box-Muller normals),
mapped to float32 and rounded to bf16 with round-to-nearest-even."""

from __future__ import annotations

import math

import ml_dtypes
import numba
import numpy as np

from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.layout import (
    NORM_TENSORS,
    BlockKind,
    BlockLayout,
    embed_layout,
    head_layout,
    layer_layout,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
EMBED_STD = 1.0
_CHUNK_ELEMS = 1 << 13
"""Work item size: 8 Ki elements through a 32 KiB fp32 scratch buffer (small enough that malloc
reuses it instead of mmap-ing and faulting in fresh pages for every item). Even, so Box-Muller
pairs never straddle two items."""
_ONES, _UNIFORM, _NORMAL = 0, 1, 2
_BF16_ONE = 0x3F80
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_KIND_CODE = {BlockKind.EMBED: 1, BlockKind.LAYER: 2, BlockKind.HEAD: 3}


class ModelWeights:
    """All blocks of one model: `embed` (1-D bf16, embed_layout), `layers` (one 1-D bf16 array per
    layer, layer_layout) and `head` (1-D bf16, head_layout). Holds arrays, so not frozen."""

    def __init__(
        self, cfg: ModelConfig, embed: np.ndarray, layers: list[np.ndarray], head: np.ndarray
    ):
        if len(layers) != cfg.n_layers:
            raise ConfigError(
                f"model '{cfg.name}' has {cfg.n_layers} layers, got "
                f"{len(layers)} layer blocks; pass one block per layer"
            )
        self.cfg = cfg
        self.embed = _check_block(embed, embed_layout(cfg), "embed")
        self.layers = [
            _check_block(b, layer_layout(cfg), f"layer {i}") for i, b in enumerate(layers)
        ]
        self.head = _check_block(head, head_layout(cfg), "head")

    @classmethod
    def empty(cls, cfg: ModelConfig) -> ModelWeights:
        """Uninitialised host blocks of the right sizes (np.empty: contents are garbage)."""
        return cls(
            cfg,
            np.empty(embed_layout(cfg).numel, BF16),
            [np.empty(layer_layout(cfg).numel, BF16) for _ in range(cfg.n_layers)],
            np.empty(head_layout(cfg).numel, BF16),
        )

    def blocks(self) -> list[tuple[BlockKind, int | None, BlockLayout, np.ndarray]]:
        """(kind, layer or None, layout, array) for every block, in file order."""
        cfg = self.cfg
        out = [(BlockKind.EMBED, None, embed_layout(cfg), self.embed)]
        lay = layer_layout(cfg)
        out += [(BlockKind.LAYER, i, lay, b) for i, b in enumerate(self.layers)]
        out.append((BlockKind.HEAD, None, head_layout(cfg), self.head))
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for *_, b in self.blocks())


def _check_block(block, layout: BlockLayout, what: str) -> np.ndarray:
    if not isinstance(block, np.ndarray):
        raise ConfigError(
            f"{what} block must be a NumPy array in host memory, got "
            f"{type(block).__name__}; copy device arrays to the host first"
        )
    if block.dtype != BF16 or block.ndim != 1 or block.size != layout.numel:
        raise ConfigError(
            f"{what} block must be a 1-D bfloat16 array of {layout.numel} "
            f"elements, got {block.dtype} with shape {block.shape}; allocate "
            f"np.empty({layout.numel}, ml_dtypes.bfloat16)"
        )
    if not block.flags.c_contiguous:
        raise ConfigError(f"{what} block must be C-contiguous; pass np.ascontiguousarray(...)")
    return block


def _splitmix64(z: int) -> int:
    """splitmix64 on Python ints (for the per-tensor keys; the kernel has its own copy)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _tensor_key(seed: int, kind: BlockKind, layer: int, tensor: int) -> int:
    key = _splitmix64(seed)
    for part in (_KIND_CODE[kind], layer, tensor):
        key = _splitmix64(key ^ part)
    return key


@numba.njit(cache=True, inline="always")
def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _round_bf16(src, dst):
    """float32 -> bf16 bits, round to nearest even; NaN -> sign | 0x7FC0 (as ml_dtypes)."""
    bits = src.view(np.uint32)
    for j in range(bits.size):
        b = np.int64(bits[j])
        if (b & 0x7FFFFFFF) > 0x7F800000:
            dst[j] = np.uint16(((b >> 16) & 0x8000) | 0x7FC0)
        else:
            dst[j] = np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@numba.njit(cache=True)
def _normal_pairs(buf, key, pair0, std):
    """Box-Muller: pair p (elements 2p, 2p+1 of the tensor) from two 24-bit uniforms of one
    64-bit hash; fills buf[2k], buf[2k+1] with pair pair0 + k."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    for k in range(buf.size // 2):
        h = _mix64(key + np.uint64(pair0 + k + 1) * golden)
        u1 = (np.float64(h >> np.uint64(40)) + 0.5) * 2.0**-24
        u2 = (np.float64(h & np.uint64(0xFFFFFF)) + 0.5) * 2.0**-24
        r = math.sqrt(-2.0 * math.log(u1)) * std
        buf[2 * k] = np.float32(r * math.cos(2.0 * math.pi * u2))
        buf[2 * k + 1] = np.float32(r * math.sin(2.0 * math.pi * u2))


@numba.njit(parallel=True, cache=True)
def _fill(dst, t_offset, t_kind, t_scale, t_key, item_tensor, item_start, item_len):
    """Fill work items (a tensor's elements [start, start+len)) of the uint16 view `dst`."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    for i in numba.prange(item_tensor.size):
        t = item_tensor[i]
        start = item_start[i]
        n = item_len[i]
        base = t_offset[t] + start
        kind = t_kind[t]
        if kind == _ONES:
            dst[base : base + n] = _BF16_ONE
        elif kind == _NORMAL:
            buf = np.empty(n + 1, np.float32)
            _normal_pairs(buf, t_key[t], start // 2, t_scale[t])
            _round_bf16(buf[:n], dst[base : base + n])
        else:
            buf = np.empty(n, np.float32)
            key = t_key[t]
            scale = t_scale[t]
            for j in range(n):
                h = _mix64(key + np.uint64(start + j + 1) * golden)
                hi = np.float64(h >> np.uint64(40)) + 0.5  # 24 bits -> (0, 2^24)
                buf[j] = np.float32((hi * 2.0**-23 - 1.0) * scale)
            _round_bf16(buf, dst[base : base + n])


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """The rounding the initialiser uses: float32 array -> uint16 bf16 bits (same shape)."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    dst = np.empty(src.shape, np.uint16)
    _round_bf16(src.reshape(-1), dst.reshape(-1))
    return dst


def _check_seed(seed: int) -> int:
    if (
        isinstance(seed, bool)
        or not isinstance(seed, (int, np.integer))
        or not (0 <= seed <= _MASK64)
    ):
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}; pass e.g. seed=0")
    return int(seed)


def _init_block(layout: BlockLayout, layer: int, seed: int, out, what: str,
                tied: bool = False) -> np.ndarray:
    seed = _check_seed(seed)
    if out is None:
        out = np.empty(layout.numel, BF16)
    _check_block(out, layout, what)
    bits = out.view(np.uint16)
    n_t = len(layout.tensors)
    t_offset = np.array([t.offset for t in layout.tensors], np.int64)
    t_kind = np.empty(n_t, np.int64)
    t_scale = np.empty(n_t, np.float64)
    t_key = np.empty(n_t, np.uint64)
    t_items = np.empty(n_t, np.int64)
    end = 0
    for i, t in enumerate(layout.tensors):
        bits[end : t.offset] = 0  # alignment padding
        end = t.offset + t.numel
        if t.name in NORM_TENSORS:
            t_kind[i], t_scale[i] = _ONES, 1.0
        elif layout.kind is BlockKind.EMBED and not tied:
            t_kind[i], t_scale[i] = _NORMAL, EMBED_STD
        elif t.name.endswith(".bias"):  # nn.Linear's bias: the fan_in of its weight
            fan_in = layout.slot(t.name[: -len(".bias")]).shape[1]
            t_kind[i], t_scale[i] = _UNIFORM, 1.0 / math.sqrt(fan_in)
        else:
            t_kind[i], t_scale[i] = _UNIFORM, 1.0 / math.sqrt(t.shape[1])
        t_key[i] = _tensor_key(seed, layout.kind, layer, i)
        t_items[i] = -(-t.numel // _CHUNK_ELEMS)
    bits[end:] = 0
    # Work items built as arrays, not Python tuples: 8b has about a million of them.
    item_tensor = np.repeat(np.arange(n_t, dtype=np.int64), t_items)
    first = np.cumsum(t_items) - t_items
    item_start = (np.arange(item_tensor.size, dtype=np.int64) - first[item_tensor]) * _CHUNK_ELEMS
    t_numel = np.array([t.numel for t in layout.tensors], np.int64)
    item_len = np.minimum(_CHUNK_ELEMS, t_numel[item_tensor] - item_start)
    _fill(
        bits,
        t_offset,
        t_kind,
        t_scale,
        t_key,
        item_tensor,
        item_start,
        item_len,
    )
    return out


def init_layer_block(cfg: ModelConfig, layer: int, seed: int, out=None) -> np.ndarray:
    """Layer `layer`'s block: 1-D bf16 of layer_layout(cfg).numel elements, padding zero.
    `out`: a host bf16 array of that size to fill instead of allocating."""
    if (
        isinstance(layer, bool)
        or not isinstance(layer, (int, np.integer))
        or not (0 <= layer < cfg.n_layers)
    ):
        raise ConfigError(
            f"layer {layer!r} is outside model '{cfg.name}', which has "
            f"{cfg.n_layers} layers; pass 0 <= layer < {cfg.n_layers}"
        )
    return _init_block(layer_layout(cfg), int(layer), seed, out, f"layer {layer}")


def init_embed_block(cfg: ModelConfig, seed: int, out=None) -> np.ndarray:
    """The embedding block (V, D), normal(0, EMBED_STD), as one 1-D bf16 array; a tied one
    (cfg.tie_embeddings) is also the head's projection, so it starts as an untied lm_head would,
    uniform ±1/sqrt(D) (normal(0, 1) rows would put logits at sqrt(D) scale)."""
    return _init_block(embed_layout(cfg), 0, seed, out, "embed", tied=cfg.tie_embeddings)


def init_head_block(cfg: ModelConfig, seed: int, out=None) -> np.ndarray:
    """The head block: final norm (ones) and lm_head (V, D) uniform ±1/sqrt(D) (the norm alone
    when the head is tied to the embedding)."""
    return _init_block(head_layout(cfg), 0, seed, out, "head")


def init_model(cfg: ModelConfig, seed: int) -> ModelWeights:
    """Every block of `cfg`, freshly allocated in host memory and initialised from `seed`."""
    w = ModelWeights.empty(cfg)
    init_embed_block(cfg, seed, out=w.embed)
    for layer, block in enumerate(w.layers):
        init_layer_block(cfg, layer, seed, out=block)
    init_head_block(cfg, seed, out=w.head)
    return w


def state_dict(weights: ModelWeights) -> dict[str, np.ndarray]:
    """transformers-named views (no copies) in transformers' shapes, e.g.
    'model.layers.0.self_attn.q_proj.weight' -> (H*E, D) bf16. Writing to a view writes the
    block."""
    out = {}
    for _, layer, layout, block in weights.blocks():
        for t in layout.tensors:
            out[layout.full_name(t.name, layer)] = layout.view(block, t.name)
    return out
