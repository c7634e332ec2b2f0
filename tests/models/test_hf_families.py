"""Model families beside Llama: a Mistral directory (MistralForCausalLM: Llama's computation, its
own config.json spelling, a sliding window) imports, trains as itself and exports in Mistral's
spelling; a window shorter than the sequence and the families whose computation is not built
(Qwen2-MoE, Mixtral, Gemma, ...) are refused by name. Qwen2 and Qwen3: test_qwen_families.py;
OLMoE and Qwen3-MoE: test_hf_moe.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.hf import hf_config_dict
from dataflow.models.hf_config import hf_config

st_numpy = pytest.importorskip("safetensors.numpy")

ODD = ModelConfig(name="odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=3, n_heads=4,
                  n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)
MISTRAL = dataclasses.replace(ODD, family="mistral", sliding_window=4096)


def _engine(model, **kw):
    return Engine(model, host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy",
                  max_grad_norm=None, **kw)


def _dir(path, cfg: ModelConfig, tensors: dict):
    path.mkdir()
    st_numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    return path


def _tensors(rng) -> dict:
    with _engine(ODD) as eng:
        shapes = {k: v.shape for k, v in eng.state_dict().items() if not k.startswith("optim")}
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def test_mistral_config_is_written_in_mistrals_spelling_and_read_back():
    d = hf_config_dict(MISTRAL)
    assert d["model_type"] == "mistral" and d["architectures"] == ["MistralForCausalLM"]
    assert d["sliding_window"] == 4096 and "attention_bias" not in d
    assert hf_config_dict(ODD)["model_type"] == "llama"


def test_a_mistral_directory_trains_as_the_same_weights_under_llama_and_exports_as_mistral(
        tmp_path, rng):
    """Mistral computes what Llama computes (within its window): the same tensors under
    either config.json give the same losses bit for bit; the export keeps the family."""
    tensors = _tensors(rng)
    m = _dir(tmp_path / "mistral", MISTRAL, tensors)
    ll = _dir(tmp_path / "llama", ODD, tensors)
    cfg = hf_config(m)
    assert cfg.family == "mistral" and cfg.sliding_window == 4096
    batches = [rng.integers(0, ODD.vocab_size, (8, 65), dtype=np.int32) for _ in range(3)]
    losses = {}
    for name, path in (("mistral", m), ("llama", ll)):
        with _engine(str(path), seqs_per_step=8) as eng:
            losses[name] = [eng.train_step(b).loss for b in batches]
            if name == "mistral":
                eng.save_pretrained(tmp_path / "out")
    assert losses["mistral"] == losses["llama"]
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["model_type"] == "mistral" and out["sliding_window"] == 4096


def test_a_window_shorter_than_the_sequence_is_refused_naming_both():
    short = dataclasses.replace(MISTRAL, sliding_window=32)
    with pytest.raises(ConfigError, match="sliding window of 32 tokens.*seqlen 64"):
        make_plan(short, 64, Budget.from_gib(1, 1), get_profile("cpu"))
    make_plan(short, 32, Budget.from_gib(1, 1), get_profile("cpu"))  # within it: fine


@pytest.mark.parametrize("family,why", [("qwen2_moe", "shared expert"),
                                        ("mixtral", "mixture-of-experts"),
                                        ("gemma", "GeLU"), ("gpt2", "not built")])
def test_families_not_built_are_refused_with_what_is_missing(tmp_path, family, why):
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(ODD),
                                                      "model_type": family}))
    with pytest.raises(ConfigError, match=f"model_type '{family}'.*{why}"):
        hf_config(tmp_path)


def test_the_mistral_zoo_entry_has_the_released_shape_and_plans():
    cfg = load_config("mistral-7b")
    assert (cfg.family, cfg.vocab_size, cfg.n_layers, cfg.n_kv_heads, cfg.ffn_dim) == \
        ("mistral", 32768, 32, 8, 14336)
    assert 7.2e9 < cfg.n_params < 7.3e9  # Mistral-7B-v0.3: 7.25 B
    assert make_plan(cfg, 8192, Budget.from_gib(80, 24), get_profile("h100")).prediction.tok_per_s > 0
