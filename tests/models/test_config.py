"""Model configs: the zoo's shapes exactly as issue 2 lists them, loading by name or path with
errors that list what would work, and a strict JSON round trip through dataflow.models.serial."""

import dataclasses
import json

import pytest

from dataflow.models.config import ModelConfig, load_config, zoo_names
from dataflow.models.errors import ConfigError
from dataflow.models.serial import SCHEMA_VERSION, from_dict, from_json, to_dict

# vocab / d / head_dim / layers / heads / kv_heads / ffn / rope_theta, copied from issue 2.
ZOO = {
    "1b": (128256, 2048, 64, 16, 32, 8, 8192, 5e5),
    "8b": (128256, 4096, 128, 32, 32, 8, 14336, 5e5),
    "15b": (128256, 4096, 128, 64, 32, 8, 14336, 5e5),
    "32b": (152064, 5120, 128, 64, 40, 8, 27648, 1e6),
}
FIELDS = ("vocab_size", "model_dim", "head_dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
          "rope_theta")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_have_exactly_the_issue_2_shapes(name):
    """1b, 8b, 15b and 32b load with the listed shapes, RMSNorm eps 1e-5 and their own name."""
    cfg = load_config(name)
    assert tuple(getattr(cfg, f) for f in FIELDS) == ZOO[name]
    assert cfg.norm_eps == 1e-5 and cfg.name == name


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_test_models_are_small_gqa_llamas(name):
    """tiny and small have a few layers, d <= 256, vocab <= 1024 (>= 256 for the byte-level
    shipped text) and grouped-query attention."""
    cfg = load_config(name)
    assert cfg.n_layers <= 8 and cfg.model_dim <= 256 and 256 <= cfg.vocab_size <= 1024
    assert cfg.n_kv_heads < cfg.n_heads and cfg.n_heads % cfg.n_kv_heads == 0
    assert cfg.norm_eps == 1e-5


def test_zoo_names_list_test_models_first_then_by_size():
    """zoo_names() is tiny, small, then by the size the name ends with (a family's prefix
    aside; one size's names alphabetically; an MoE by its total): 1b, llama3.2-1b, mistral-7b,
    olmoe-1b-7b, qwen2.5-7b, 8b, qwen3-8b, 15b, qwen3-30b-a3b, 32b, 70b."""
    assert zoo_names() == ["tiny", "small", "1b", "llama3.2-1b", "mistral-7b", "olmoe-1b-7b",
                           "qwen2.5-7b", "8b", "qwen3-8b", "15b", "qwen3-30b-a3b", "32b", "70b"]


def test_load_config_refuses_an_unknown_name_and_lists_the_known_ones():
    """An unknown model name raises ConfigError naming it and every zoo model."""
    with pytest.raises(ConfigError) as err:
        load_config("llama8b")
    message = str(err.value)
    assert "'llama8b'" in message
    for name in zoo_names():
        assert name in message


@pytest.mark.parametrize("name", ["tiny", "8b", "32b"])
def test_config_round_trips_through_json(name):
    """to_json then from_json gives an equal config; the text has sorted keys and the schema
    version."""
    cfg = load_config(name)
    text = cfg.to_json()
    data = json.loads(text)
    assert data["schema_version"] == SCHEMA_VERSION
    assert list(data) == sorted(data)
    assert from_json(ModelConfig, text) == cfg


def test_load_config_reads_a_json_file_and_a_model_directory(tmp_path):
    """A config JSON path and a directory holding config.json load the same config."""
    cfg = dataclasses.replace(load_config("tiny"), name="mine", n_layers=3)
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert load_config(tmp_path / "config.json") == cfg
    assert load_config(tmp_path) == cfg


def test_unknown_config_keys_are_refused_beside_the_known_ones():
    """A config with an extra key raises ConfigError naming it and listing the known keys."""
    data = to_dict(load_config("tiny")) | {"n_expert": 8}
    with pytest.raises(ConfigError, match=r"unknown keys \['n_expert'\]; known keys are \[.*"
                                          r"'ffn_dim'"):
        from_dict(ModelConfig, data)


def test_missing_and_mistyped_config_keys_are_refused():
    """A missing field and a float where an int is needed are refused by name."""
    data = to_dict(load_config("tiny"))
    del data["ffn_dim"]
    with pytest.raises(ConfigError, match="missing key 'ffn_dim'"):
        from_dict(ModelConfig, data)
    data = to_dict(load_config("tiny")) | {"n_layers": 2.5}
    with pytest.raises(ConfigError, match="n_layers.*2.5"):
        from_dict(ModelConfig, data)


def test_config_refuses_heads_that_do_not_group_and_odd_head_dim():
    """n_heads not a multiple of n_kv_heads, or an odd head_dim, is refused with the values."""
    base = to_dict(load_config("tiny"))
    with pytest.raises(ConfigError, match="n_heads 4 is not a multiple of n_kv_heads 3"):
        from_dict(ModelConfig, base | {"n_kv_heads": 3})
    with pytest.raises(ConfigError, match="head_dim 15"):
        from_dict(ModelConfig, base | {"head_dim": 15})


def test_config_is_frozen():
    """A loaded config cannot be modified in place (derive a new one with dataclasses.replace)."""
    cfg = load_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3
