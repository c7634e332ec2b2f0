"""The FP8-stored frozen base of a LoRA plan (`--lora-base fp8`, docs/lora.md): where each tensor
of a layer block sits when the seven adapted linears (q, k, v, o, gate, up, down) are stored as
E4M3 codes (1 byte an element) with one fp32 scale per output row, and the NumPy reference of
that quantisation (scale = row amax / 448; a zero row gets scale 1; a row holding inf or NaN is
refused: models.fp8_quant is that quantiser). Norms and the family's extra vectors stay bf16.
Pure offsets: never imports array libraries (the planner reads it), never decides placement (the
planner says whether a plan uses this layout).

A block is still handed around as a 1-D bf16 array of `numel` elements (the streaming machinery
moves bytes); this layout says which bytes are codes, scales or bf16 values."""

from __future__ import annotations

import dataclasses
import math

from dataflow.models.config import ModelConfig
from dataflow.models.layout import BlockKind, BlockLayout, layer_layout

E4M3_MAX = 448.0
"""The largest finite E4M3 value: a row's amax maps onto it."""
ALIGN_BYTES = 256
"""Every tensor, its codes and its scales start on a 256-byte boundary (as models.layout)."""
FP8_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""The linears stored as codes and row scales: the seven LoRA targets' base weights."""


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Slot:
    """One tensor of an FP8-base layer block. A linear (`fp8`) has `rows` x `cols` E4M3 codes at
    byte `codes_offset` and `rows` fp32 scales at `scales_offset`; any other tensor is bf16 at
    byte `codes_offset` (scales_offset -1)."""

    name: str
    shape: tuple[int, ...]
    codes_offset: int
    scales_offset: int

    @property
    def fp8(self) -> bool:
        return self.scales_offset >= 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8LayerLayout:
    """A layer block whose linears are E4M3 codes with row scales: `bf16` is the block it
    encodes (models.layout.layer_layout), `tensors` its slots in that order, `numel` the block's
    size in bf16 elements (nbytes / 2, what the slots, copies and regions count)."""

    bf16: BlockLayout
    tensors: tuple[Fp8Slot, ...]
    nbytes: int

    kind = BlockKind.LAYER

    @property
    def numel(self) -> int:
        return self.nbytes // 2

    def slot(self, name: str) -> Fp8Slot:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor '{name}' in the fp8-base layer block; "
                       f"it holds {[t.name for t in self.tensors]}")

    def full_name(self, name: str, layer: int | None = None) -> str:
        return self.bf16.full_name(name, layer)


def fp8_layer_layout(cfg: ModelConfig) -> Fp8LayerLayout:
    """The layer block of `cfg` with FP8_TENSORS as codes + row scales (dense models only: the
    LoRA path refuses mixture-of-experts models)."""
    if cfg.moe is not None:
        raise ValueError(f"{cfg.name}: an fp8 base is laid out for dense layers only")
    base = layer_layout(cfg)
    slots, at = [], 0
    for t in base.tensors:
        if t.name in FP8_TENSORS:
            rows = t.shape[0]
            codes = at
            at += _align(t.numel)
            slots.append(Fp8Slot(name=t.name, shape=t.shape, codes_offset=codes,
                                 scales_offset=at))
            at += _align(4 * rows)
        else:
            slots.append(Fp8Slot(name=t.name, shape=t.shape, codes_offset=at, scales_offset=-1))
            at += _align(2 * t.numel)
    return Fp8LayerLayout(bf16=base, tensors=tuple(slots), nbytes=at)


def fp8_host_bytes(cfg: ModelConfig) -> int:
    """Bytes of one FP8-base layer block (against layer_layout(cfg).nbytes in bf16)."""
    return fp8_layer_layout(cfg).nbytes


def largest_linear(cfg: ModelConfig) -> int:
    """Elements of the largest of FP8_TENSORS: the bf16 dequantised copy's region holds one."""
    lay = layer_layout(cfg)
    return max(lay.slot(n).numel for n in FP8_TENSORS)
