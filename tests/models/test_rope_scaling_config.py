"""RoPE scaling in configs and Hugging Face directories: ModelConfig carries Llama 3.1's
`rope_scaling` through JSON (and leaves configs without it byte-identical), refuses bad values
naming them, imports it from config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`),
exports it back exactly, refuses other rope types naming the type and what is supported, and an
imported scaled model trains with the scaled frequencies in every RoPE op of the engine."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pytest

from dataflow import ops_numpy
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.optimizer import AdamWConfig
from dataflow.reference_trainer import ReferenceTrainer
from dataflow.kernels.reference import rope_inv_freq
from dataflow.models.config import ModelConfig, RopeScaling, RopeType, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.hf import hf_config_dict
from dataflow.models.hf_config import hf_config
from dataflow.models.init import BF16
from dataflow.models.serial import from_dict, from_json, stable_hash, to_dict, to_json

st_numpy = pytest.importorskip("safetensors.numpy")

LLAMA31 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
           "original_max_position_embeddings": 8192, "rope_type": "llama3"}
"""rope_scaling exactly as Llama-3.1-8B's config.json has it."""
SCALED = ModelConfig(name="scaled", vocab_size=300, model_dim=64, head_dim=16, n_layers=2,
                     n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=1e4, norm_eps=1e-5,
                     rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0,
                                              original_max_position_embeddings=256))


def _scaling(**kw) -> RopeScaling:
    args = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    return RopeScaling(**{**args, **kw})


def test_config_with_rope_scaling_round_trips_through_json():
    """to_json/from_json keeps rope_scaling (type by value), and the object stays hashable."""
    cfg = dataclasses.replace(load_config("8b"), rope_scaling=_scaling())
    text = to_json(cfg)
    assert json.loads(text)["rope_scaling"] == LLAMA31
    back = from_json(ModelConfig, text)
    assert back == cfg and back.rope_scaling.rope_type is RopeType.LLAMA3
    assert hash(back) == hash(cfg)


@pytest.mark.parametrize("name", ["tiny", "1b", "8b"])
def test_config_without_rope_scaling_keeps_its_json_and_hash(name):
    """A config with no scaling writes no rope_scaling key, so JSON and plan hashes recorded
    before the field existed still match."""
    cfg = load_config(name)
    legacy = json.loads(resources.files("dataflow.models.zoo").joinpath(f"{name}.json").read_text())
    assert cfg.rope_scaling is None and to_dict(cfg) == legacy
    assert stable_hash(cfg) == stable_hash(from_dict(ModelConfig, legacy))


@pytest.mark.parametrize("kw,match", [
    ({"factor": 0.0}, "factor"), ({"factor": float("nan")}, "factor"),
    ({"low_freq_factor": -1.0}, "low_freq_factor"),
    ({"high_freq_factor": 1.0}, "greater than low_freq_factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"original_max_position_embeddings": 8192.5}, "original_max_position_embeddings"),
    ({"rope_type": "llama3"}, "RopeType"), ({"rope_type": "yarn"}, "'yarn'.*llama3"),
])
def test_rope_scaling_refuses_bad_values_naming_them(kw, match):
    """Each bad field is refused with a ConfigError naming it (and, for a type, what works)."""
    with pytest.raises(ConfigError, match=match):
        _scaling(**kw)


def test_json_with_an_unsupported_rope_type_is_refused_naming_it_and_llama3():
    """A config JSON whose rope_scaling has another rope_type names it and 'llama3'."""
    data = json.loads(to_json(dataclasses.replace(load_config("tiny"),
                                                  rope_scaling=_scaling())))
    data["rope_scaling"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match=r"'yarn'.*llama3"):
        from_dict(ModelConfig, data)


def _write_config(path, **over) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf_config_dict(SCALED), **over}))


def test_hf_config_imports_llama31_rope_scaling_and_exports_it_exactly(tmp_path):
    """config.json with Llama 3.1's rope_scaling imports to a RopeScaling, and hf_config_dict
    writes rope_scaling back equal, key for key, with a max_position_embeddings above the
    original context (transformers warns otherwise)."""
    _write_config(tmp_path, rope_scaling=LLAMA31, rope_theta=500000.0,
                  max_position_embeddings=131072)
    cfg = hf_config(tmp_path)
    assert cfg.rope_scaling == _scaling() and cfg.rope_theta == 500000.0
    out = hf_config_dict(cfg)
    assert out["rope_scaling"] == LLAMA31 and out["rope_theta"] == 500000.0
    assert out["max_position_embeddings"] > LLAMA31["original_max_position_embeddings"]
    assert hf_config_dict(load_config("tiny"))["rope_scaling"] is None


def test_hf_config_reads_transformers5_rope_parameters_and_legacy_type_key(tmp_path):
    """transformers 5's rope_parameters (theta inside) and the old 'type' spelling import the
    same config; 'default' is plain RoPE."""
    data = hf_config_dict(SCALED)
    del data["rope_scaling"], data["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(
        {**data, "rope_parameters": {**LLAMA31, "rope_theta": 500000.0}}))
    assert hf_config(tmp_path).rope_scaling == _scaling()
    assert hf_config(tmp_path).rope_theta == 500000.0
    legacy = {k: v for k, v in LLAMA31.items() if k != "rope_type"}
    _write_config(tmp_path, rope_scaling={**legacy, "type": "llama3"})
    assert hf_config(tmp_path).rope_scaling == _scaling()
    _write_config(tmp_path, rope_scaling={"rope_type": "default"})
    assert hf_config(tmp_path).rope_scaling is None


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_type 'yarn' is not supported.*'llama3'"),
    ({"type": "linear", "factor": 2.0}, r"rope_type 'linear' is not supported.*'llama3'"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic'.*'llama3'"),
    ({**LLAMA31, "attention_factor": 1.0}, r"rope_scaling.*unknown \['attention_factor'\]"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_scaling.*missing"),
    ({**LLAMA31, "factor": "8"}, r"rope_scaling factor '8' is not a number"),
    ({**LLAMA31, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "greater than"),
])
def test_hf_config_refuses_rope_scaling_it_cannot_run_naming_it(tmp_path, scaling, match):
    """Other rope types are refused naming the type and what is supported; a llama3 entry with
    missing, unknown or bad keys names them; the message names the file."""
    _write_config(tmp_path, rope_scaling=scaling)
    with pytest.raises(ConfigError, match=match) as err:
        hf_config(tmp_path)
    assert "config.json" in str(err.value)


def _hf_dir(path, rng, cfg: ModelConfig) -> dict:
    """A single-file Hugging Face directory of `cfg` with random bf16 weights (via the package)."""
    with Engine(cfg, host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
        shapes = {k: v.shape for k, v in eng.state_dict().items()
                  if not k.startswith("optimizer.")}
    tensors = {k: (0.1 * rng.standard_normal(s)).astype(BF16) for k, s in shapes.items()}
    path.mkdir()
    st_numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config_dict(cfg),
                                                  "max_position_embeddings": 131072}))
    return tensors


def test_scaled_hf_model_imports_trains_like_the_reference_and_exports_back(tmp_path, rng,
                                                                            monkeypatch):
    """Engine(model=hf_dir) of a rope_scaling directory: every RoPE op gets the scaled table,
    two steps match the reference trainer within bf16 tolerance, and save_pretrained writes the
    same rope_scaling back."""
    _hf_dir(tmp_path / "m", rng, SCALED)
    seen = []
    for op in ("rope_fwd", "rope_bwd"):
        real = getattr(ops_numpy, op)

        def spy(x, positions, inv_freq, out, _real=real):
            seen.append(np.asarray(inv_freq))
            _real(x, positions, inv_freq, out)
        monkeypatch.setattr(ops_numpy, op, spy)
    opt = AdamWConfig(lr=1e-3, max_grad_norm=None)  # the reference trainer does not clip
    with Engine(str(tmp_path / "m"), host_gb=0.5, dev_gb=0.25, seqlen=64, seqs_per_step=2,
                backend="numpy", optimizer=opt, sanitize=True) as eng:
        cfg, rows = eng.plan.model, eng.seqs_per_step
        assert cfg.rope_scaling == SCALED.rope_scaling
        weights = eng.weights()
        batches = [token_stream(64, rows, cfg.vocab_size, start=s * rows * 64) for s in range(2)]
        losses = [eng.train_step(b).loss for b in batches]
        eng.save_pretrained(tmp_path / "out")
    want = rope_inv_freq(16, 1e4, (4.0, 1.0, 4.0, 256))
    assert seen and all(np.array_equal(t, want) for t in seen)
    ref = ReferenceTrainer(cfg, weights, lr=1e-3)
    ref_losses = [ref.train_step(b).loss_mean for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_scaling"] == hf_config_dict(SCALED)["rope_scaling"]
    assert hf_config(tmp_path / "out") == dataclasses.replace(SCALED, name="out")
