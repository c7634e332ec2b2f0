"""Hugging Face interop on a small shape that is not in the zoo: our safetensors reader and
writer agree with the `safetensors` package, an export reads back exactly with the package and
transformers' config names, and a directory written in that layout imports exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.hf import HFWeights, save_pretrained
from dataflow.models.hf_config import hf_config, is_hf_dir
from dataflow.models.init import BF16
from dataflow.models.safetensors_io import SafetensorsFile, save_file

st_numpy = pytest.importorskip("safetensors.numpy")

ODD = ModelConfig(name="odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=3, n_heads=4,
                  n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)


def _engine(model=ODD, **kw):
    return Engine(model, host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", **kw)


def _params(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("optimizer.")}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def test_reader_reads_what_the_package_writes(tmp_path, rng):
    """bf16, fp16, fp32 and int tensors written by safetensors.numpy read back bit-exactly."""
    tensors = {"a": rng.standard_normal((5, 7)).astype(BF16),
               "b": rng.standard_normal(11).astype(np.float16),
               "c": rng.standard_normal((2, 3, 4)).astype(np.float32),
               "d": rng.integers(-9, 9, (4,)).astype(np.int64)}
    st_numpy.save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(f.names()) == sorted(tensors) and f.metadata == {"format": "pt"}
    for k, v in tensors.items():
        got = f.tensor(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert np.array_equal(got.view(np.uint8), v.view(np.uint8)), k


def test_package_reads_what_the_writer_writes(tmp_path, rng):
    """Our streaming writer's files load in the package with identical bytes and metadata."""
    tensors = {"w": rng.standard_normal((3, 9)).astype(BF16),
               "n": rng.standard_normal(13).astype(np.float32)}
    save_file(tensors, tmp_path / "y.safetensors", metadata={"format": "pt"})
    got = st_numpy.load_file(tmp_path / "y.safetensors")
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k].view(np.uint8),
                                                          v.view(np.uint8)), k
    from safetensors import safe_open

    with safe_open(tmp_path / "y.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_export_reads_back_exactly_with_the_package(tmp_path, max_shard_bytes):
    """save_pretrained writes transformers' config and bf16 tensors under transformers' names;
    one file or shards with an index; every tensor equals state_dict() bit for bit."""
    out = tmp_path / "hf"
    with _engine(seed=3) as eng:
        want = _params(eng.state_dict())
        if max_shard_bytes is None:
            eng.save_pretrained(out)
        else:
            blocks = ((r.kind, r.layer, eng.read_block(r)) for r in eng.block_refs())
            save_pretrained(ODD, blocks, out, max_shard_bytes=max_shard_bytes)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["rope_theta"], cfg["rms_norm_eps"],
            cfg["tie_word_embeddings"]) == (64, 96, 3, 4, 2, 16, 300, 5e4, 1e-6, False)
    if max_shard_bytes is None:
        files = ["model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and sorted(index["weight_map"]) == sorted(want)
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    got = {}
    for name in files:
        got.update(st_numpy.load_file(out / name))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == BF16 and got[k].shape == v.shape
        assert np.array_equal(_bits(got[k]), _bits(v)), k
    assert hf_config(out, name="odd") == ODD


def _hf_dir(path, tensors: dict, config: dict, shards: int = 2):
    """Write `tensors` in transformers' layout with the package (sharded, with an index)."""
    path.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        st_numpy.save_file(part, path / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


def _random_hf_tensors(rng, dtype) -> dict:
    with _engine() as eng:
        shapes = {k: v.shape for k, v in _params(eng.state_dict()).items()}
    return {k: (0.1 * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_import_of_a_hf_directory_gives_identical_weights(tmp_path, rng, dtype):
    """Engine(model=hf_dir) loads every tensor; bf16 exactly, fp32 rounded to nearest bf16."""
    from dataflow.models.hf import hf_config_dict

    tensors = _random_hf_tensors(rng, dtype)
    _hf_dir(tmp_path / "m", tensors, hf_config_dict(ODD))
    assert is_hf_dir(tmp_path / "m")
    with _engine(str(tmp_path / "m")) as eng:
        got = _params(eng.state_dict())
        assert eng.plan.model.n_layers == 3 and eng.plan.model.name == "m"
        eng.save_pretrained(tmp_path / "again")
    for k, v in tensors.items():
        assert np.array_equal(_bits(got[k]), _bits(v.astype(BF16))), k
    again = st_numpy.load_file(tmp_path / "again" / "model.safetensors")
    assert all(np.array_equal(_bits(again[k]), _bits(got[k])) for k in got)


def test_tied_embeddings_import_as_one_table(tmp_path, rng):
    """A tie_word_embeddings directory (no lm_head.weight) imports tied: the embedding block
    holds the table and the head block only the final norm (tests/models/test_tied_embeddings.py
    checks training and export)."""
    from dataflow.models.hf import hf_config_dict

    tensors = _random_hf_tensors(rng, BF16)
    del tensors["lm_head.weight"]
    _hf_dir(tmp_path / "t", tensors, {**hf_config_dict(ODD), "tie_word_embeddings": True}, 1)
    weights = HFWeights(tmp_path / "t")
    assert weights.cfg.tie_embeddings and weights.tied
    blocks = list(weights.blocks())
    assert [t.name for t in blocks[-1][2].tensors] == ["norm"]
    assert np.array_equal(_bits(blocks[0][2].view(blocks[0][3], "embed_tokens")),
                          _bits(tensors["model.embed_tokens.weight"]))


@pytest.mark.parametrize("key,value", [("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
                                       ("attention_bias", True), ("hidden_act", "gelu"),
                                       ("model_type", "gpt2")])
def test_configs_we_cannot_run_exactly_are_refused_by_name(tmp_path, key, value):
    """RoPE scaling, biases, other activations or architectures are refused, naming the key."""
    from dataflow.models.hf import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(ODD), key: value}))
    with pytest.raises(ConfigError, match=key):
        hf_config(tmp_path)


def test_reader_refuses_a_truncated_file_naming_it(tmp_path, rng):
    """A safetensors file cut short is refused with its path, never read past its end."""
    save_file({"w": rng.standard_normal(64).astype(np.float32)}, tmp_path / "z.safetensors")
    data = (tmp_path / "z.safetensors").read_bytes()
    (tmp_path / "z.safetensors").write_bytes(data[:-10])
    with pytest.raises(ConfigError, match="z.safetensors"):
        SafetensorsFile(tmp_path / "z.safetensors")


def test_export_cli_writes_a_checkpoint_as_hf_and_refuses_a_bad_source(tmp_path, capsys):
    """dataflow-export turns the newest checkpoint under a root into a HF directory whose
    tensors equal the engine's; a path that is neither checkpoint nor model exits 2."""
    from dataflow.cli.export import main

    with _engine(seed=4) as eng:
        eng.save_checkpoint(tmp_path / "run")
        want = _params(eng.state_dict())
    assert main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    got = st_numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert all(np.array_equal(_bits(got[k]), _bits(v)) for k, v in want.items())
    (tmp_path / "junk").mkdir()
    assert main([str(tmp_path / "junk"), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "junk" in err and "Traceback" not in err
