"""The engine's side of an FP8-stored frozen base (`--lora-base fp8`, Lora.base; docs/lora.md):
a layer block's linears as E4M3 codes with fp32 row scales (dataflow.models.fp8_layout), bound
to typed views for the layer compute, decoded into the plan's lora.base_dequant region right
before each base GEMM, and translated at the engine's edge (a bf16 block written is quantised
once; a block read back is the dequantised, FP8-rounded base). Never decides placement and never
calls CuPy or NumPy kernels directly on the device (the decode is the op table's
fp8_base_dequant, enqueued on the compute stream)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow.backend import Stream
from dataflow.block_io import is_host_array
from dataflow.models.fp8_layout import Fp8LayerLayout, fp8_layer_layout
from dataflow.models.fp8_quant import decode_block, encode_block
from dataflow.models.layout import layer_layout

REGION = "lora.base_dequant"
"""The device region (dataflow.memplan.plan.lora.region_sizes) one dequantised linear lives in."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Weight:
    """One linear of an fp8-base block: codes (O, I) uint8 (E4M3 bits) and scales (O,) fp32."""

    codes: object
    scales: object

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


def fp8_base(plan) -> bool:
    """The plan stores its frozen base's linears in fp8 (Plan.lora.base)."""
    return plan.lora is not None and plan.lora.fp8_base


def stored_layer_layout(plan):
    """The layout a layer block is stored in under `plan`: Fp8LayerLayout for an fp8 base, else
    dataflow.models.layout.layer_layout."""
    return fp8_layer_layout(plan.model) if fp8_base(plan) else layer_layout(plan.model)


def block_views(view, ref, lay: Fp8LayerLayout) -> dict:
    """The tensors of an fp8-base layer block at `ref` by name: Fp8Weight for each linear, a bf16
    view for the rest. `view(ref, shape, dtype, byte_offset)` is the executor's typed view."""
    out = {}
    for t in lay.tensors:
        if t.fp8:
            out[t.name] = Fp8Weight(view(ref, t.shape, "u8", t.codes_offset),
                                    view(ref, (t.shape[0],), "f32", t.scales_offset))
        else:
            out[t.name] = view(ref, t.shape, "bf16", t.codes_offset)
    return out


class BaseDequant:
    """Decodes an Fp8Weight into the lora.base_dequant region (flat bf16 `region`, sized for the
    largest linear) and hands the GEMM that (O, I) bf16 view. One region serves every base GEMM:
    they all run on the compute stream, so a decode never overtakes the GEMM reading the last."""

    def __init__(self, be, region):
        self.be, self.region = be, region

    def weight(self, w, name: str):
        """`w` itself when it is a bf16 array; an Fp8Weight decoded (fp8_base_dequant on the
        compute stream) into the region's first O * I elements."""
        if not isinstance(w, Fp8Weight):
            return w
        rows, cols = w.shape
        out = self.region[:rows * cols].reshape(rows, cols)
        self.be.launch(Stream.COMPUTE, "fp8_base_dequant", w.codes, w.scales, out,
                       name=f"{name}.fp8_base_dequant")
        return out


def base_decoder(plan, be, arena) -> BaseDequant | None:
    """The decoder of an fp8-base plan's layer compute, on its lora.base_dequant region of the
    device arena `arena` (dataflow.arena.Arena); None for any other plan."""
    if not fp8_base(plan):
        return None
    return BaseDequant(be, arena.view(REGION, (arena.nbytes(REGION) // 2,), "bf16"))


def user_layout(lay):
    """The layout the engine's users read and write a block in: an fp8-base layer block's bf16
    layout (its tensors keep their names and shapes), any other layout itself."""
    return lay.bf16 if isinstance(lay, Fp8LayerLayout) else lay


def to_stored(b, array, part: str = "weights"):
    """`array` as block `b` stores it: a bf16 layer block (the bf16 layout's numel) of an
    fp8-base layer quantised once (dataflow.models.fp8_quant.encode_block, ValueError naming a
    non-finite row); anything else as given."""
    lay = b.layout
    if not isinstance(lay, Fp8LayerLayout) or part != "weights" \
            or np.asarray(array).size != lay.bf16.numel:
        return array
    return encode_block(lay, array, layer=b.layer)


def write_weights(ex, be, b, array) -> bool:
    """Quantise a bf16 layer block straight into block `b`'s pinned home copy (no packed
    temporary beside the plan's host memory) and upload it when `b` is resident; True when
    done so, False when `b` is no fp8-base layer with a host home (the caller writes it)."""
    lay, home = b.layout, b.home("weights")
    if not isinstance(lay, Fp8LayerLayout) or np.asarray(array).size != lay.bf16.numel \
            or not is_host_array(home):
        return False
    be.synchronize()  # a queued copy may still read or write this home copy
    encode_block(lay, array, out=home, layer=b.layer)
    if b.resident and b.device("weights") is not None:
        be.copy(b.device("weights"), home, Stream.H2D, name="upload")  # pinned: async
    return True


def from_stored(b, array, part: str = "weights"):
    """Block `b`'s stored `array` as users see it: an fp8-base layer's weights dequantised to
    its bf16 layout (codes * row scale, one rounding: the FP8-rounded base)."""
    lay = b.layout
    if not isinstance(lay, Fp8LayerLayout) or part != "weights":
        return array
    return decode_block(lay, array)


def init_fill(lay, fill, layer: int | None):
    """A block initialiser (dataflow.block_io.init_weights' `fill`) for layout `lay`: for an
    fp8-base layer, `fill` (which writes a bf16 layer block) then the quantisation into `out`
    (one bf16 layer block is a temporary: its codes are what stays)."""
    if not isinstance(lay, Fp8LayerLayout):
        return fill

    def fp8_fill(out):
        return encode_block(lay, fill(None), out=out, layer=layer)
    return fp8_fill
