"""The NumPy reference of the FP8-stored frozen base (models.fp8_layout, docs/lora.md): per output
row, scale = amax / 448 in fp32 (1 for a zero row), codes = E4M3(w / scale) rounded to nearest even;
a row holding inf or NaN is refused by name. Encodes a bf16 layer block into the fp8-base block
(through models.fp8_quant_fast, the same bits compiled) and decodes it back (codes * row scale, one
rounding to bf16: the base the engine trains against). Host-side maths only: never touches a device,
never decides placement."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dataflow.models.fp8_layout import E4M3_MAX, Fp8LayerLayout, Fp8Slot
from dataflow.models.fp8_quant_fast import quantise_rows_fast

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)


def quantise_rows(w, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """(codes (O, I) uint8, scales (O,) float32) of a (O, I) weight (any float dtype): per row,
    scale = amax / 448 in fp32 (1 for a zero row), codes = E4M3(w / scale), rounded to nearest
    even (|w / scale| <= 448, so nothing saturates). Raises ValueError naming `name` and the
    first row holding inf or NaN."""
    x = np.asarray(w).astype(np.float32)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        row = int(np.argmin(finite))
        raise ValueError(f"{name}: row {row} holds inf or NaN; an fp8 base needs finite "
                         "weights (fix the checkpoint, or use --lora-base bf16)")
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(x / scales[:, None], -E4M3_MAX, E4M3_MAX)
    return q.astype(E4M3).view(np.uint8), scales


def dequantise_rows(codes, scales) -> np.ndarray:
    """float32 (O, I): decode(codes) * scale of its row, in fp32 (exact decode, one rounding)."""
    return np.asarray(codes).view(E4M3).astype(np.float32) * np.asarray(scales, np.float32)[:, None]


def encode_block(lay: Fp8LayerLayout, block, out: np.ndarray | None = None,
                 layer: int | None = None) -> np.ndarray:
    """The fp8-base block (1-D bf16 array of lay.numel, its bytes as lay says) of a bf16 layer
    block `block` (layer_layout's numel elements); into `out` when given. `layer` names the
    tensors in errors."""
    block = np.asarray(block)
    if block.size != lay.bf16.numel:
        raise ValueError(f"a layer block has {lay.bf16.numel} bf16 elements, got {block.size}")
    if out is None:
        out = np.zeros(lay.numel, np.dtype(BF16))
    raw = out.view(np.uint8)
    _zero_gaps(lay, raw)
    for t in lay.tensors:
        w = lay.bf16.view(block, t.name)
        if t.fp8:
            # the numba quantiser: these bits, ~10x faster (a 70b base loads in seconds)
            codes, scales = quantise_rows_fast(w, lay.full_name(t.name, layer))
            raw[t.codes_offset:t.codes_offset + t.numel] = codes.reshape(-1)
            raw[t.scales_offset:t.scales_offset + 4 * t.shape[0]] = scales.view(np.uint8)
        else:
            raw[t.codes_offset:t.codes_offset + 2 * t.numel] = \
                np.ascontiguousarray(w.astype(BF16)).reshape(-1).view(np.uint8)
    return out


def _zero_gaps(lay: Fp8LayerLayout, raw: np.ndarray) -> None:
    """Zero the alignment bytes between a block's tensors (an `out` given may hold anything:
    the stored bytes must be the same on every backend and every run)."""
    spans = sorted([(t.codes_offset, t.codes_offset + t.numel) for t in lay.tensors if t.fp8]
                   + [(t.scales_offset, t.scales_offset + 4 * t.shape[0])
                      for t in lay.tensors if t.fp8]
                   + [(t.codes_offset, t.codes_offset + 2 * t.numel)
                      for t in lay.tensors if not t.fp8])
    at = 0
    for start, end in spans:
        if start > at:
            raw[at:start] = 0
        at = max(at, end)
    raw[at:] = 0


def decode_block(lay: Fp8LayerLayout, packed) -> np.ndarray:
    """The bf16 layer block (layer_layout's numel) an fp8-base block stands for: every linear
    dequantised (codes * row scale in fp32, rounded once to bf16), the rest as stored."""
    raw = np.ascontiguousarray(np.asarray(packed)).view(np.uint8)
    out = np.zeros(lay.bf16.numel, np.dtype(BF16))
    for t in lay.tensors:
        dst = lay.bf16.view(out, t.name)
        if t.fp8:
            codes, scales = split_views(raw, t)
            dst[...] = dequantise_rows(codes, scales).astype(BF16)
        else:
            dst[...] = raw[t.codes_offset:t.codes_offset + 2 * t.numel].view(
                BF16).reshape(t.shape)
    return out


def split_views(raw: np.ndarray, t: Fp8Slot) -> tuple[np.ndarray, np.ndarray]:
    """(codes (O, I) uint8, scales (O,) float32) of linear `t` inside a block's bytes `raw`."""
    rows, cols = t.shape
    codes = raw[t.codes_offset:t.codes_offset + rows * cols].reshape(rows, cols)
    scales = raw[t.scales_offset:t.scales_offset + 4 * rows].view(np.float32)
    return codes, scales
