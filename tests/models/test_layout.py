"""Block layouts: every tensor aligned, none overlapping, all of transformers' tensors present
with its names and shapes, bf16 bytes round-tripping exactly, and 8b's parameter count."""

import ml_dtypes
import numpy as np
import pytest

from dataflow.models.config import load_config, zoo_names
from dataflow.models.layout import ALIGN_ELEMS, BlockKind, embed_layout, head_layout, layer_layout

BF16 = np.dtype(ml_dtypes.bfloat16)


def layouts(cfg):
    return [embed_layout(cfg), layer_layout(cfg), head_layout(cfg)]


def transformers_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """state_dict names and shapes of transformers' LlamaForCausalLM (untied head), by hand."""
    d, e, f, v = cfg.model_dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    q, kv = cfg.n_heads * e, cfg.n_kv_heads * e
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d),
                   p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d),
                   p + "self_attn.o_proj.weight": (d, q),
                   p + "post_attention_layernorm.weight": (d,),
                   p + "mlp.gate_proj.weight": (f, d),
                   p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
    return shapes


@pytest.mark.parametrize("name", zoo_names())
def test_block_tensors_are_aligned_to_128_elements_and_do_not_overlap(name):
    """Each tensor starts on a multiple of 128 elements, ends before the next begins, and the
    block's numel is the aligned end of its last tensor."""
    assert ALIGN_ELEMS == 128
    for layout in layouts(load_config(name)):
        end = 0
        for slot in sorted(layout.tensors, key=lambda s: s.offset):
            assert slot.offset % 128 == 0, (layout.kind, slot.name, slot.offset)
            assert slot.offset >= end, f"{slot.name} overlaps the tensor before it"
            end = slot.offset + slot.numel
        assert layout.numel % 128 == 0 and end <= layout.numel < end + 128
        assert layout.nbytes == 2 * layout.numel


@pytest.mark.parametrize("name", ["tiny", "8b", "32b"])
def test_layouts_cover_every_transformers_tensor_with_its_name_and_shape(name):
    """The embed, layer (for every layer index) and head blocks name exactly transformers'
    state_dict keys, with linear weights shaped [out_features, in_features]."""
    cfg = load_config(name)
    got = {}
    for layout in layouts(cfg):
        layers = range(cfg.n_layers) if layout.kind is BlockKind.LAYER else [None]
        for layer in layers:
            for slot in layout.tensors:
                key = layout.full_name(slot.name, layer)
                assert key not in got, f"{key} appears twice"
                got[key] = slot.shape
    assert got == transformers_shapes(cfg)


def test_views_see_each_tensor_at_its_offset(rng):
    """layout.view returns a (no-copy) view of the block at the slot's offset and shape."""
    cfg = load_config("tiny")
    layout = layer_layout(cfg)
    block = np.zeros(layout.numel, np.float32)
    for slot in layout.tensors:
        values = rng.standard_normal(slot.shape).astype(np.float32)
        layout.view(block, slot.name)[...] = values
        np.testing.assert_array_equal(block[slot.offset:slot.offset + slot.numel],
                                      values.reshape(-1))
    assert np.shares_memory(layout.view(block, "mlp.up_proj"), block)
    with pytest.raises(KeyError, match="no tensor 'mlp.w1'.*mlp.up_proj"):
        layout.slot("mlp.w1")


def test_bf16_round_trip_through_a_layer_block_equals_ml_dtypes_cast(rng):
    """Random float32 written into a bf16 block and read back equals ml_dtypes' own cast bit for
    bit, and writing one tensor leaves the others and the padding untouched."""
    cfg = load_config("small")
    layout = layer_layout(cfg)
    block = np.zeros(layout.numel, BF16)
    written = {}
    for slot in layout.tensors:
        values = (rng.standard_normal(slot.shape) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        layout.view(block, slot.name)[...] = values.astype(BF16)
        written[slot.name] = values
    covered = np.zeros(layout.numel, bool)
    for slot in layout.tensors:
        back = layout.view(block, slot.name)
        assert back.dtype == BF16
        np.testing.assert_array_equal(back.view(np.uint16),
                                      written[slot.name].astype(BF16).view(np.uint16))
        covered[slot.offset:slot.offset + slot.numel] = True
    assert np.all(block[~covered].view(np.uint16) == 0)


def test_8b_parameter_count_is_8030261248():
    """8b has 8,030,261,248 parameters (Llama-3-8B), in its config and in its block layouts."""
    cfg = load_config("8b")
    in_layouts = (sum(s.numel for s in embed_layout(cfg).tensors)
                  + cfg.n_layers * sum(s.numel for s in layer_layout(cfg).tensors)
                  + sum(s.numel for s in head_layout(cfg).tensors))
    assert cfg.n_params == in_layouts == 8_030_261_248
