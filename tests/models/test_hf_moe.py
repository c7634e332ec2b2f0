"""Hugging Face OLMoE and Qwen3-MoE directories (OlmoeForCausalLM, Qwen3MoeForCausalLM) in and
out on small shapes that are not in the zoo: config.json in each family's spelling, the
released per-expert tensor names, a bit-exact round trip of random weights, transformers 5's
fused experts read as the same weights, the released configs read as the zoo entries, and every
variant we do not model refused by name."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dataflow.models.config import MoE, ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.hf import HFWeights, hf_config_dict, save_pretrained
from dataflow.models.hf_config import hf_config
from dataflow.models.init import BF16
from dataflow.models.layout import embed_layout, head_layout, layer_layout
from dataflow.models.safetensors_io import SafetensorsFile, save_file

BASE = dict(vocab_size=61, model_dim=32, n_layers=2, n_kv_heads=2, rope_theta=1e4,
            norm_eps=1e-6, qk_norm=True)
OLMOE = ModelConfig(name="olmoe-odd", family="olmoe", head_dim=8, n_heads=4, ffn_dim=16,
                    **BASE, moe=MoE(n_experts=5, top_k=2, expert_ffn_dim=16,
                                    norm_topk_prob=False, router_aux_loss_coef=0.2,
                                    router_z_loss_coef=0.02))
"""OLMoE's QK-norm over the whole projections (q_norm (32,), k_norm (16,)); a z-loss, which
only the `router_z_loss_coef` key carries."""
QWEN3_MOE = ModelConfig(name="qwen3-moe-odd", family="qwen3_moe", head_dim=16, n_heads=4,
                        ffn_dim=24, **BASE, moe=MoE(n_experts=6, top_k=3, expert_ffn_dim=12,
                                                    norm_topk_prob=True,
                                                    router_aux_loss_coef=0.3))
"""head_dim 16 over model_dim 32 (q_dim 64): Qwen3-MoE's explicit head_dim."""
TIED = dataclasses.replace(QWEN3_MOE, name="tied-moe-odd", tie_embeddings=True)
CONFIGS = {"olmoe": OLMOE, "qwen3_moe": QWEN3_MOE, "tied": TIED}


def _layouts(cfg):
    lay = layer_layout(cfg)
    return ([("embed", None, embed_layout(cfg))] + [("layer", i, lay) for i in range(cfg.n_layers)]
            + [("head", None, head_layout(cfg))])


def _random_blocks(cfg, rng) -> list:
    """(kind, layer, 1-D bf16 block) with every tensor element drawn away from zero."""
    out = []
    for kind, layer, lay in _layouts(cfg):
        block = np.zeros(lay.numel, BF16)
        for t in lay.tensors:
            mag = rng.uniform(0.05, 1.0, t.shape) * rng.choice([-1.0, 1.0], t.shape)
            lay.view(block, t.name)[...] = mag.astype(BF16)
        out.append((lay.kind, layer, block))
    return out


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_moe_directory_round_trips_bit_exact_in_its_familys_spelling(tmp_path, rng, family,
                                                                     max_shard_bytes):
    """save_pretrained writes config.json in the family's spelling and every tensor under the
    released per-expert names; hf_config reads the same ModelConfig back and HFWeights the same
    bits, one file or shards."""
    cfg = CONFIGS[family]
    blocks = _random_blocks(cfg, rng)
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    out = save_pretrained(cfg, iter(blocks), tmp_path / "hf", **kw)
    data = json.loads((out / "config.json").read_text())
    m = cfg.moe
    assert data["model_type"] == cfg.family
    assert (data["num_experts"], data["num_experts_per_tok"], data["norm_topk_prob"],
            data["router_aux_loss_coef"], data["output_router_logits"]) == \
        (m.n_experts, m.top_k, m.norm_topk_prob, m.router_aux_loss_coef, True)
    if cfg.family == "olmoe":
        assert data["architectures"] == ["OlmoeForCausalLM"]
        assert data["intermediate_size"] == m.expert_ffn_dim and data["clip_qkv"] is None
        assert data["router_z_loss_coef"] == 0.02 and "head_dim" not in data
    else:
        assert data["architectures"] == ["Qwen3MoeForCausalLM"]
        assert (data["moe_intermediate_size"], data["intermediate_size"], data["head_dim"],
                data["decoder_sparse_step"], data["mlp_only_layers"]) == (12, 24, 16, 1, [])
        assert "router_z_loss_coef" not in data and data["use_sliding_window"] is False
    assert data["tie_word_embeddings"] is cfg.tie_embeddings
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(files) > 1) == (max_shard_bytes is not None)
    names = {n: SafetensorsFile(out / f).shape(n) for f in files
             for n in SafetensorsFile(out / f).names()}
    assert names["model.layers.0.mlp.gate.weight"] == (m.n_experts, 32)
    assert names[f"model.layers.1.mlp.experts.{m.n_experts - 1}.gate_proj.weight"] == \
        (m.expert_ffn_dim, 32)
    assert names["model.layers.1.mlp.experts.0.down_proj.weight"] == (32, m.expert_ffn_dim)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (cfg.qk_norm_dims[0],)
    assert ("lm_head.weight" in names) is not cfg.tie_embeddings
    assert len(names) == 3 + 2 * (6 + 1 + 3 * m.n_experts + 2) - cfg.tie_embeddings
    assert hf_config(out, name=cfg.name) == cfg
    got = list(HFWeights(out).blocks())
    assert [(k, i) for k, i, _, _ in got] == [(k, i) for k, i, _ in blocks]
    for (_, _, _, block), (_, _, want) in zip(got, blocks):
        assert np.array_equal(_bits(block), _bits(want))


def _fuse(tensors: dict, cfg, layers) -> dict:
    """transformers 5's layout of `layers`: per layer gate_up_proj (N, 2F, D), gate then up
    along dim 1, and down_proj (N, D, F); the per-expert tensors of those layers removed."""
    out = dict(tensors)
    for i in layers:
        pre = f"model.layers.{i}.mlp.experts"
        per = {w: [out.pop(f"{pre}.{e}.{w}.weight") for e in range(cfg.moe.n_experts)]
               for w in ("gate_proj", "up_proj", "down_proj")}
        out[f"{pre}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in
                                               zip(per["gate_proj"], per["up_proj"])])
        out[f"{pre}.down_proj"] = np.stack(per["down_proj"])
    return out


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_fused_experts_of_transformers_5_import_as_the_released_tensors(tmp_path, rng, family):
    """A directory whose experts are stored fused (all layers, or one layer fused and one per
    expert) gives the same bits as the per-expert directory, in bf16 and from fp32; exported
    again, it is written under the released per-expert names."""
    cfg = CONFIGS[family]
    save_pretrained(cfg, iter(_random_blocks(cfg, rng)), tmp_path / "per")
    tensors = {n: np.array(SafetensorsFile(tmp_path / "per" / "model.safetensors").tensor(n))
               for n in SafetensorsFile(tmp_path / "per" / "model.safetensors").names()}
    want = [b for *_, b in HFWeights(tmp_path / "per").blocks()]
    config = (tmp_path / "per" / "config.json").read_text()
    for name, layers, dtype in (("all", range(cfg.n_layers), BF16), ("one", [1], np.float32)):
        d = tmp_path / name
        d.mkdir()
        fused = {k: v.astype(dtype) for k, v in _fuse(tensors, cfg, layers).items()}
        save_file(fused, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(config)
        got = [b for *_, b in HFWeights(d).blocks()]
        assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want)), name
    weights = HFWeights(tmp_path / "all")
    save_pretrained(weights.cfg, ((k, i, b) for k, i, _, b in weights.blocks()),
                    tmp_path / "again")
    again = SafetensorsFile(tmp_path / "again" / "model.safetensors")
    assert sorted(again.names()) == sorted(tensors)


def test_mixed_or_half_fused_experts_are_refused_naming_the_layer(tmp_path, rng):
    """A layer holding fused and per-expert tensors both, or gate_up_proj without down_proj,
    or a fused tensor of the wrong shape is refused, naming the layer or tensor."""
    cfg = OLMOE
    save_pretrained(cfg, iter(_random_blocks(cfg, rng)), tmp_path / "per")
    src = SafetensorsFile(tmp_path / "per" / "model.safetensors")
    tensors = {n: np.array(src.tensor(n)) for n in src.names()}
    fused = _fuse(tensors, cfg, [0])
    config = (tmp_path / "per" / "config.json").read_text()
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    bad = {"mixed": {**fused, "model.layers.0.mlp.experts.0.gate_proj.weight":
                     tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]},
           "half": {k: v for k, v in fused.items() if k != "model.layers.0.mlp.experts.down_proj"},
           "shape": {**fused, gate_up: fused[gate_up][:, :-1]}}
    needles = {"mixed": "layer 0 stores both.*per-expert", "half": "layer 0 stores only",
               "shape": "gate_up_proj' has shape"}
    for name, ts in bad.items():
        d = tmp_path / name
        d.mkdir()
        save_file(ts, d / "model.safetensors")
        (d / "config.json").write_text(config)
        with pytest.raises(ConfigError, match=needles[name]):
            list(HFWeights(d).blocks())


RELEASED = {
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "eos_token_id": 50279,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe",
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
        "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 50304},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
}
"""config.json of allenai/OLMoE-1B-7B-0924 and Qwen/Qwen3-30B-A3B as released (transcribed)."""


@pytest.mark.parametrize("zoo", sorted(RELEASED))
def test_released_configs_read_as_the_zoo_entries_and_export_reads_back(tmp_path, zoo):
    """The released config.json is the zoo entry; the zoo entry's export reads back as it."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[zoo]))
    assert hf_config(tmp_path, name=zoo) == load_config(zoo)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(load_config(zoo))))
    assert hf_config(tmp_path, name=zoo) == load_config(zoo)


@pytest.mark.parametrize("family,key,value,needle", [
    ("olmoe", "clip_qkv", 8.0, "clip_qkv 8.0"),
    ("qwen3_moe", "mlp_only_layers", [0], r"mlp_only_layers \[0\]"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step 2"),
    ("qwen3_moe", "use_sliding_window", True, "use_sliding_window"),
    ("olmoe", "layer_types", ["sliding_attention"] * 2, "layer_types"),
    ("qwen3_moe", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ("olmoe", "attention_bias", True, "attention_bias"),
    ("olmoe", "head_dim", 16, "head_dim 16"),
    ("qwen3_moe", "num_experts_per_tok", 7, "top_k 7 is more than n_experts 6"),
    ("qwen3_moe", "num_local_experts", 8, "num_local_experts 8"),
    ("olmoe", "hidden_act", "gelu", "hidden_act"),
    ("qwen3_moe", "model_type", "qwen2_moe", "qwen2_moe.*shared expert"),
    ("qwen3_moe", "model_type", "mixtral", "mixtral.*not built"),
])
def test_moe_variants_we_do_not_model_are_refused_by_name(tmp_path, family, key, value, needle):
    """Each variant transformers would compute differently is a ConfigError naming the key."""
    data = {**hf_config_dict(CONFIGS[family]), key: value}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=needle):
        hf_config(tmp_path)


def test_export_refuses_what_the_familys_config_cannot_say(tmp_path):
    """Shared experts (neither family has them) and OLMoE heads narrower than model_dim /
    n_heads are refused by name, before anything is written."""
    shared = dataclasses.replace(QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe,
                                                                    n_shared_experts=1))
    with pytest.raises(ConfigError, match="1 shared experts cannot be written as "
                                          "Qwen3MoeForCausalLM"):
        save_pretrained(shared, [], tmp_path / "out")
    narrow = dataclasses.replace(OLMOE, head_dim=4)
    with pytest.raises(ConfigError, match="OlmoeConfig has no head_dim"):
        hf_config_dict(narrow)
    assert not (tmp_path / "out").exists()
