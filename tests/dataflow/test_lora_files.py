"""LoRA's files: a checkpoint of the adapters alone resumes bit for bit (2 steps, save, resume,
2 steps == 4 steps), refuses another base or Lora; the PEFT adapter directory reads back with
the right keys, shapes and values; merged weights equal base + s B A."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataflow import Engine
from dataflow.kernels.reference.lora import merged_weight
from dataflow.memplan.plan.lora import Lora
from dataflow.models.errors import ConfigError
from dataflow.models.safetensors_io import SafetensorsFile

LORA = Lora(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))
HF = {"q": "self_attn.q_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "down": "mlp.down_proj"}


def _engine(lora=LORA, seed=0):
    return Engine("tiny", host_gb=1, dev_gb=0.5, seqlen=32, backend="numpy", lr=3e-3,
                  seed=seed, lora=lora)


def _batches(eng, seed, n):
    rng = np.random.default_rng(seed)
    ch = eng.plan.chunking
    return [rng.integers(0, eng.plan.model.vocab_size, (ch.seqs_per_step, ch.seqlen + 1))
            for _ in range(n)]


def test_lora_checkpoint_resumes_bit_exact(tmp_path):
    """Train 2 steps, save, resume in a fresh engine, 2 more == 4 steps straight, bit for bit
    (adapters, AdamW m and v, losses); the checkpoint holds no base weights."""
    a = _engine()
    batches = _batches(a, 21, 4)
    losses_a = [a.train_step(b).loss for b in batches]
    want = a.lora_state()
    b = _engine()
    for bt in batches[:2]:
        b.train_step(bt)
    path = b.save_checkpoint(tmp_path / "ck")
    files = sorted(p.name for p in path.iterdir())
    assert files == ["checkpoint.json.sha256", "lora_checkpoint.json", "lora_state.safetensors"]
    meta = json.loads((path / "lora_checkpoint.json").read_text())
    assert meta["step"] == 2 and meta["base"]["model"] == "tiny"
    c = _engine()
    c.load_checkpoint(path)
    assert c.step == 2
    losses_c = [c.train_step(bt).loss for bt in batches[2:]]
    assert losses_c == losses_a[2:]
    got = c.lora_state()
    for k, v in want.items():
        assert np.array_equal(got[k], v), k
    for e in (a, b, c):
        e.close()


def test_lora_checkpoint_refuses_another_lora(tmp_path):
    """Adapters of another rank or targets are refused by name, nothing loaded."""
    a = _engine()
    a.train_step(_batches(a, 22, 1)[0])
    path = a.save_checkpoint(tmp_path / "ck")
    other = _engine(Lora(rank=2, alpha=8.0, targets=("q",)))
    with pytest.raises(ConfigError, match="rank=4"):
        other.load_checkpoint(path)
    a.close()
    other.close()


def test_peft_export_round_trip_and_merged_weights(tmp_path):
    """adapter_config.json says LORA, r, alpha, HF module names; the safetensors keys and shapes
    are PEFT's and hold our adapters; merged weights are base + s B A."""
    eng = _engine()
    rng = np.random.default_rng(23)
    st = {k: v for k, v in eng.lora_state().items() if k.endswith((".a", ".b"))}
    st = {k: (rng.standard_normal(v.shape).astype(np.float32) * 0.1 if k.endswith(".b") else v)
          for k, v in st.items()}
    eng.load_lora_state(st)
    out = eng.export_peft(tmp_path / "adapter", base_model="some/base")
    cfg_json = json.loads((out / "adapter_config.json").read_text())
    assert cfg_json["peft_type"] == "LORA" and cfg_json["r"] == 4
    assert cfg_json["lora_alpha"] == 8.0 and cfg_json["bias"] == "none"
    assert cfg_json["task_type"] == "CAUSAL_LM" and cfg_json["base_model_name_or_path"] == "some/base"
    assert cfg_json["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    f = SafetensorsFile(out / "adapter_model.safetensors")
    cfg = eng.plan.model
    assert len(f.names()) == 2 * 4 * cfg.n_layers
    for i in range(cfg.n_layers):
        for t, mod in HF.items():
            stem = f"base_model.model.model.layers.{i}.{mod}"
            a, b = f.tensor(f"{stem}.lora_A.weight"), f.tensor(f"{stem}.lora_B.weight")
            assert a.shape[0] == 4 and b.shape[1] == 4
            assert np.array_equal(a, st[f"layers.{i}.{t}.a"])
            assert np.array_equal(b, st[f"layers.{i}.{t}.b"])
    with pytest.raises(ConfigError, match="exists"):
        eng.export_peft(out)
    merged = eng.save_merged(tmp_path / "merged")
    base = eng.state_dict()
    m = {}
    for p in sorted(merged.glob("*.safetensors")):
        sf = SafetensorsFile(p)
        m.update({k: np.array(sf.tensor(k)) for k in sf.names()})
    for i in range(cfg.n_layers):
        for t, mod in HF.items():
            key = f"model.layers.{i}.{mod}.weight"
            want = merged_weight(base[key], st[f"layers.{i}.{t}.a"], st[f"layers.{i}.{t}.b"],
                                 LORA.scale)
            assert np.array_equal(m[key], want), key
            assert not np.array_equal(m[key], base[key])
        key = f"model.layers.{i}.self_attn.k_proj.weight"  # not a target: the base's bits
        assert np.array_equal(m[key], base[key])
    eng.close()


def test_demo_trains_lora_resumes_it_and_refuses_bad_flags(tmp_path, capsys):
    """dataflow-demo --lora-rank trains, saves and resumes adapters; a bad target, a rank of 0
    and --lora-rank with --gpus exit 2 naming the problem."""
    from dataflow.cli.demo import main as demo_main

    argv = ["1", "0.5", "64", "tiny", "--backend", "numpy", "--lora-rank", "4",
            "--lora-targets", "q,v,down", "--checkpoint-dir", str(tmp_path / "run"),
            "--save-every", "1"]
    assert demo_main(argv + ["--steps", "1"]) == 0
    assert demo_main(argv + ["--steps", "2", "--resume"]) == 0
    assert (tmp_path / "run" / "step_00000002" / "lora_checkpoint.json").is_file()
    capsys.readouterr()
    assert demo_main(["1", "0.5", "64", "tiny", "--backend", "numpy", "--lora-rank", "4",
                      "--lora-targets", "q,qq"]) == 2
    assert "'qq'" in capsys.readouterr().err
    assert demo_main(["1", "0.5", "64", "tiny", "--backend", "numpy", "--lora-rank", "0"]) == 2
    assert demo_main(["1", "0.5", "64", "tiny", "--gpus", "2", "--lora-rank", "4"]) == 2
    assert "--lora-rank" in capsys.readouterr().err
