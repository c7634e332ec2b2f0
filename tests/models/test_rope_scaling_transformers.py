"""Our logits against transformers' LlamaForCausalLM for a tiny random Llama with Llama 3.1-style
rope_scaling, loaded by transformers from our own export: ours must sit much closer to the scaled
transformers model than to the same weights with plain RoPE. Needs torch and transformers (the
GPU machine has them; never a dependency of the project): skipped without them. Runs on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_numpy = pytest.importorskip("safetensors.numpy")

from dataflow.engine import Engine  # noqa: E402
from dataflow.host_forward import logits  # noqa: E402
from dataflow.models.config import ModelConfig, RopeScaling  # noqa: E402
from dataflow.models.hf import hf_config_dict  # noqa: E402
from dataflow.models.init import BF16  # noqa: E402

CFG = ModelConfig(name="tiny-llama3", vocab_size=256, model_dim=64, head_dim=16, n_layers=2,
                  n_heads=4, n_kv_heads=2, ffn_dim=128, rope_theta=1e4, norm_eps=1e-5,
                  rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=256))
SEQLEN = 128


def _random_hf_dir(path, rng) -> None:
    """CFG's tensors under transformers' names, bf16; q/k projections large enough that
    attention is sharp and so depends on the rotation angles."""
    with Engine(CFG, host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN, seqs_per_step=1,
                backend="numpy") as eng:
        shapes = {k: v.shape for k, v in eng.state_dict().items()
                  if not k.startswith("optimizer.")}
    tensors = {}
    for k, s in shapes.items():
        std = 0.3 if ("q_proj" in k or "k_proj" in k) else 0.1
        t = std * rng.standard_normal(s)
        tensors[k] = (1.0 + t if k.endswith("norm.weight") else t).astype(BF16)
    path.mkdir()
    st_numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config_dict(CFG),
                                                  "max_position_embeddings": 1024}))


def _theirs(path, ids, *, plain: bool) -> np.ndarray:
    config = transformers.AutoConfig.from_pretrained(path)
    if plain:
        config.rope_scaling = None
        if hasattr(config, "rope_parameters"):  # transformers 5
            config.rope_parameters = {"rope_type": "default", "rope_theta": CFG.rope_theta}
    model = transformers.LlamaForCausalLM.from_pretrained(path, config=config,
                                                          torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def test_logits_with_llama3_rope_scaling_match_transformers(tmp_path, rng):
    """Through our engine (import, export, host forward on the trained-format bf16 weights) the
    logits of a scaled tiny Llama are within bf16 error of transformers' scaled model, and that
    error is under a tenth of the distance to the plain-RoPE model (float64 NumPy
    transcription of this check: err 2.6e-2, distance 0.82)."""
    _random_hf_dir(tmp_path / "src", rng)
    ids = rng.integers(0, CFG.vocab_size, size=(2, SEQLEN))
    with Engine(str(tmp_path / "src"), host_gb=0.5, dev_gb=0.25, seqlen=SEQLEN,
                seqs_per_step=1, backend="numpy") as eng:
        assert eng.plan.model.rope_scaling == CFG.rope_scaling
        ours = logits(eng, ids)
        eng.save_pretrained(tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["rope_scaling"] == hf_config_dict(CFG)["rope_scaling"]
    scaled = _theirs(tmp_path / "export", ids, plain=False)
    plain = _theirs(tmp_path / "export", ids, plain=True)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    err, gap = rel(ours, scaled), rel(plain, scaled)
    print(f"logits rel err vs transformers (llama3): {err:.3e}; plain-RoPE model differs by "
          f"{gap:.3e}")
    assert err < 0.1 * gap and err < 6e-2
