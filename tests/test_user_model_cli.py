"""Every command takes the model argument the demo and the Engine take (issue 51): a Hugging
Face directory written the way transformers writes it (config.json with architectures,
model_type, hidden_size, ...; model.safetensors) plans, sweeps, launches a ring and reaches the
probe's GPU check; a path that is no model, and a config.json value of the wrong type or sign,
exit 2 with one line naming it and write nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from dataflow.cli import plan as plan_cli
from dataflow.cli import probe as probe_cli
from dataflow.cli import ring as ring_cli
from dataflow.cli import sweep as sweep_cli
from dataflow.bench.sweep.table import read_table
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.hf import save_pretrained
from dataflow.models.hf_config import hf_config, model_config
from dataflow.models.hf_moe import moe_from_hf
from dataflow.models.init import init_model

SHAPE = ModelConfig(name="mine", vocab_size=256, model_dim=64, head_dim=16, n_layers=2,
                    n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=1e4, norm_eps=1e-6)


def _blocks(cfg: ModelConfig):
    return ((kind, layer, block) for kind, layer, _, block in init_model(cfg, 0).blocks())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Llama directory in transformers' layout: config.json (LlamaConfig's keys) and one
    model.safetensors under transformers' tensor names."""
    path = tmp_path_factory.mktemp("hf") / "my-model"
    save_pretrained(SHAPE, _blocks(SHAPE), path)
    data = json.loads((path / "config.json").read_text())
    assert data["architectures"] == ["LlamaForCausalLM"] and data["hidden_size"] == 64
    assert (path / "model.safetensors").is_file()
    return path


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert captured.out == ""
    return err


# -- the model argument resolves one way everywhere ---------------------------------------------
def test_plan_prints_the_plan_of_a_hugging_face_directory(hf_dir, capsys):
    """dataflow-plan takes the directory: a plan in text, and with --json the plan of exactly
    the config hf_config reads (its name the directory's)."""
    assert plan_cli.main(["1", "1", "64", str(hf_dir)]) == 0
    assert "my-model" in capsys.readouterr().out
    assert plan_cli.main(["1", "1", "64", str(hf_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["model_dim"] == 64 and doc["model"]["name"] == "my-model"
    assert ModelConfig(**{k: doc["model"][k] for k in ("name", "vocab_size", "model_dim",
                                                       "head_dim", "n_layers", "n_heads",
                                                       "n_kv_heads", "ffn_dim", "rope_theta",
                                                       "norm_eps")}) == hf_config(hf_dir)


def test_sweep_predict_only_takes_a_hugging_face_directory(hf_dir, tmp_path, capsys):
    """dataflow-sweep run --predict-only plans a grid of the directory's model."""
    out = tmp_path / "sweep"
    assert sweep_cli.main(["run", "--model", f"tiny,{hf_dir}", "--seqlen", "64", "--host", "1",
                           "--dev", "1", "--predict-only", "--gpu", "h100",
                           "--out", str(out)]) == 0
    rows = read_table(out)
    assert sorted(r.model for r in rows) == sorted(["tiny", str(hf_dir)])
    assert all(r.predicted_tok_per_s > 0 for r in rows)


def test_ring_resolves_a_hugging_face_directory_before_launching(hf_dir, capsys):
    """dataflow-ring reads the directory's shape (2 layers) and refuses a 4-rank ring of it by
    that count, before any process is spawned."""
    assert ring_cli.main(["--gpus", "4", "1", "1", "64", str(hf_dir)]) == 2
    err = _one_line(capsys)
    assert "my-model has 2" in err and "--gpus 2" in err


def test_ring_trains_a_step_of_a_hugging_face_directory_on_numpy_and_says_it_loads_no_weights(
        hf_dir, capfd):
    """A 1-step ring of 2 processes on the NumPy backend trains the directory's shape; the
    launcher says, in one note, that the ring initialises from --seed rather than loading the
    directory's weights."""
    assert ring_cli.main(["--gpus", "2", "0.5", "0.25", "64", str(hf_dir), "--steps", "1",
                          "--backend", "numpy"]) == 0
    err = capfd.readouterr().err
    assert "does not load its weights" in err and "step 1/1 loss" in err


def test_probe_accepts_the_directory_and_refuses_cleanly_without_a_gpu(hf_dir, monkeypatch,
                                                                       capsys):
    """dataflow-probe --model DIR gets past the model (a bad one would be named) to the GPU
    check: exit 2, one line saying there is no GPU."""
    monkeypatch.setattr("dataflow.backends.cupy_backend.gpu_available", lambda: False)
    assert probe_cli.main(["--model", str(hf_dir), "--out", "unused.json"]) == 2
    assert "no NVIDIA GPU" in _one_line(capsys)


@pytest.mark.parametrize("command", ["plan", "sweep", "ring", "probe"])
@pytest.mark.parametrize("case, words", [
    ("missing", "there is no file or directory"),
    ("empty", "is a directory without config.json (it holds nothing)"),
    ("weightless", "holds a Hugging Face config.json but no weights"),
    ("hf_file", "is a Hugging Face config.json: pass the directory"),
])
def test_every_command_refuses_a_path_that_is_no_model_in_one_line(command, case, words, hf_dir,
                                                                   tmp_path, monkeypatch, capsys):
    """The same one line from every command: what was found at the path and what would work
    (a zoo name, a saved model or checkpoint, a Hugging Face directory); nothing written."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "arg"
    if case == "empty":
        path.mkdir()
    elif case == "weightless":
        path.mkdir()
        shutil.copy(hf_dir / "config.json", path / "config.json")
    elif case == "hf_file":
        path = tmp_path / "config.json"
        shutil.copy(hf_dir / "config.json", path)
    monkeypatch.setattr("dataflow.backends.cupy_backend.gpu_available", lambda: True)
    argv = {"plan": ["1", "1", "64", str(path)],
            "sweep": ["run", "--model", str(path), "--seqlen", "64", "--host", "1", "--dev", "1",
                      "--predict-only", "--out", str(tmp_path / "out")],
            "ring": ["--gpus", "2", "1", "1", "64", str(path)],
            "probe": ["--model", str(path), "--out", str(tmp_path / "prof.json")]}[command]
    main = {"plan": plan_cli, "sweep": sweep_cli, "ring": ring_cli, "probe": probe_cli}[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main.main(argv) == 2
    err = _one_line(capsys)
    assert words in err and "Hugging Face directory" in err and "tiny, small" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_checkpoint_root_is_named_with_the_way_out(tmp_path):
    """A checkpoint root (step_* directories, no config.json) is called so, and the message
    says to pass one of its step directories."""
    (tmp_path / "step_00000002").mkdir()
    with pytest.raises(ConfigError, match="is a checkpoint root .* pass one of its step_"):
        model_config(tmp_path)


# -- config.json values are checked by type and sign, by key ------------------------------------
@pytest.mark.parametrize("key, value, words", [
    ("hidden_size", "64", "hidden_size must be a positive whole number, got '64' (a string); "
                          "write 64 without quotes"),
    ("hidden_size", 64.0, "hidden_size must be a positive whole number, got 64.0 (a float); "
                          "write 64"),
    ("num_hidden_layers", True, "num_hidden_layers must be a positive whole number, got true "
                                "(true/false)"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive whole number, got 0"),
    ("intermediate_size", -96, "intermediate_size must be a positive whole number, got -96"),
    ("vocab_size", 2.5, "vocab_size must be a positive whole number, got 2.5 (a float)"),
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive whole number, got 0"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive whole number, got 0"),
    ("head_dim", "16", "head_dim must be a positive whole number, got '16' (a string)"),
    ("head_dim", 15, "head_dim 15 must be even"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a positive finite number, got '1e-6' "
                             "(a string)"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a positive finite number, got 0"),
    ("rope_theta", True, "rope_theta must be a positive finite number, got true (true/false)"),
    ("rope_theta", -1.0, "rope_theta must be a positive finite number, got -1.0"),
    ("pad_token_id", "0", "pad_token_id must be a token id in 0..255 or null, got '0' "
                          "(a string)"),
    ("pad_token_id", 256, "pad_token_id must be a token id in 0..255 or null, got 256"),
    ("mlp_bias", 0, "mlp_bias = 0 is not supported"),
    ("model_type", 7, "model_type 7 is not supported (model_type must be a string)"),
    ("layer_types", "full_attention", "layer_types must be a list of strings"),
])
def test_hf_config_refuses_a_value_of_the_wrong_type_or_sign_by_key(key, value, words, hf_dir,
                                                                    tmp_path):
    """Each bad value is refused naming config.json, the key, the value (its kind when that is
    what is wrong) and what would work; nothing is converted (no int('64'), no int(64.9))."""
    path = tmp_path / "bad"
    shutil.copytree(hf_dir, path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, key: value}))
    with pytest.raises(ConfigError) as err:
        model_config(path)
    message = str(err.value)
    assert message.startswith(f"{path / 'config.json'}: ") and words in message, message
    assert "\n" not in message


def test_hidden_size_not_divisible_by_heads_without_head_dim_is_refused(hf_dir, tmp_path):
    """Without head_dim the head width is hidden_size // num_attention_heads: a remainder is
    refused with both numbers, not truncated."""
    path = tmp_path / "bad"
    shutil.copytree(hf_dir, path)
    data = json.loads((path / "config.json").read_text())
    del data["head_dim"]
    (path / "config.json").write_text(json.dumps({**data, "num_attention_heads": 3,
                                                  "num_key_value_heads": 3}))
    with pytest.raises(ConfigError, match="hidden_size 64 is not a multiple of "
                                          "num_attention_heads 3"):
        model_config(path)


@pytest.mark.parametrize("text", ["[1, 2]", "not json"])
def test_a_config_json_that_is_no_object_is_refused(text, hf_dir, tmp_path):
    """A config.json that does not parse, or is not an object, is refused naming the file."""
    path = tmp_path / "bad"
    shutil.copytree(hf_dir, path)
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="config.json"):
        hf_config(path)


def test_plan_refuses_a_mistyped_hf_value_with_exit_2_and_one_line(hf_dir, tmp_path, capsys):
    """Through the command: exit 2, one line naming the key and the value, no plan printed."""
    path = tmp_path / "bad"
    shutil.copytree(hf_dir, path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "hidden_size": "64"}))
    assert plan_cli.main(["1", "1", "64", str(path), "--json"]) == 2
    assert "hidden_size must be a positive whole number, got '64' (a string)" in _one_line(capsys)


@pytest.mark.parametrize("field, value, words", [
    ("model_dim", "64", "model_dim must be a positive whole number, got '64' (a string)"),
    ("n_layers", 2.0, "n_layers must be a positive whole number, got 2.0 (a float); write 2"),
    ("n_heads", True, "n_heads must be a positive whole number, got true (true/false)"),
    ("rope_theta", "1e4", "rope_theta must be a positive finite number, got '1e4' (a string)"),
    ("norm_eps", float("inf"), "norm_eps must be a positive finite number, got inf"),
    ("name", 5, "model name must be a non-empty string, got 5"),
])
def test_model_config_refuses_a_field_of_the_wrong_type_by_name(field, value, words):
    """ModelConfig built in Python refuses the same mistakes with a ConfigError, not a
    TypeError from a comparison."""
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(SHAPE, **{field: value})
    assert words in str(err.value)


@pytest.mark.parametrize("family, key, value, words", [
    ("olmoe", "num_experts", "64", "num_experts must be a positive whole number, got '64' "
                                   "(a string)"),
    ("olmoe", "num_experts_per_tok", 8.0, "num_experts_per_tok must be a positive whole number, "
                                          "got 8.0 (a float); write 8"),
    ("olmoe", "intermediate_size", 0, "intermediate_size must be a positive whole number, got 0"),
    ("qwen3_moe", "moe_intermediate_size", True, "moe_intermediate_size must be a positive whole "
                                                 "number, got true (true/false)"),
    ("qwen3_moe", "norm_topk_prob", "true", "norm_topk_prob must be true or false, got 'true' "
                                            "(a string)"),
    ("qwen3_moe", "decoder_sparse_step", True, "decoder_sparse_step True is not supported"),
])
def test_moe_keys_of_the_wrong_type_are_refused_by_their_config_json_name(family, key, value,
                                                                         words):
    """OlmoeConfig's and Qwen3MoeConfig's counts are checked under their own key names."""
    with pytest.raises(ConfigError) as err:
        moe_from_hf({key: value}, family, "X", "d/config.json")
    assert str(err.value).startswith("d/config.json: ") and words in str(err.value), err.value


def test_ring_reads_a_models_own_tokenizer_and_refuses_one_it_cannot_read(hf_dir, tmp_path,
                                                                          capsys):
    """dataflow-ring tokenises with the model's own tokenizer as dataflow-demo does (never the
    shipped text's byte ids unasked): a tokenizer.json the library cannot read exits 2 naming
    it and --tokenizer bytes, before launching anything."""
    mine = tmp_path / "with-tokenizer"
    shutil.copytree(hf_dir, mine)
    (mine / "tokenizer.json").write_text("{}")
    assert ring_cli.main(["1", "1", "64", str(mine), "--gpus", "2"]) == 2
    err = _one_line(capsys)
    assert "tokenizer.json" in err and "--tokenizer bytes" in err


def test_demo_trains_a_model_config_json_from_its_initialisation(tmp_path, capsys):
    """A config JSON file (the zoo's form) is a shape to initialise: the demo trains it, where it
    used to look for weights beside it and stop ('is not a model directory')."""
    from dataflow.cli import demo as demo_cli  # (as the other CLIs above, at the top: it is big)

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({
        "name": "mine", "vocab_size": 256, "model_dim": 64, "head_dim": 16, "n_layers": 2,
        "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 176, "rope_theta": 10000.0,
        "norm_eps": 1e-5}))
    assert demo_cli.main(["1", "0.25", "64", str(path), "--steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "done"
