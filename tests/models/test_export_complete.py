"""An export a user can load and generate with (issue 51): a run trained from a Hugging Face
directory exports with the source's tokenizer files and generation_config.json byte for byte and
its config values (token ids, context length, architectures), even after the source moved; a zoo
model's export says what it lacks; dataflow-export prints one summary line, names --overwrite in
its refusal, and a failed export leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from dataflow.cli.export import main
from dataflow.engine import Engine
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.hf import hf_config_dict, save_pretrained

ODD = ModelConfig(name="odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=3, n_heads=4,
                  n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)
WORDS = ["<unk>", "<s>", "</s>", "hello", "world"]
TOKENIZER_JSON = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": w, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}
                     for i, w in enumerate(WORDS[:3])],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(WORDS)},
              "unk_token": "<unk>"}}
"""A minimal valid fast tokenizer (tokenizers' WordLevel model over five words)."""
TOKENIZER_FILES = {
    "tokenizer.json": json.dumps(TOKENIZER_JSON, indent=1).encode(),
    "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                         "bos_token": "<s>", "eos_token": "</s>",
                                         "unk_token": "<unk>", "model_max_length": 512}).encode(),
    "special_tokens_map.json": b'{"bos_token": "<s>", "eos_token": "</s>"}\n',
    "chat_template.jinja": b"{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "generation_config.json": b'{"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 7}\n',
}
SOURCE_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 512,
                 "torch_dtype": "float32", "transformers_version": "4.51.0"}


def _engine(model=ODD, **kw):
    return Engine(model, host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", **kw)


QWEN3 = dataclasses.replace(ODD, name="qwen3-odd", family="qwen3", qk_norm=True, head_dim=32)


def _hf_source(path, cfg=ODD):
    """A Hugging Face directory of `cfg` with a tokenizer, a generation config and config values
    our ModelConfig does not hold (token ids, a 512-token context, fp32 stated)."""
    with _engine(cfg, seed=5) as eng:
        eng.save_pretrained(path)
    config = {**hf_config_dict(cfg), **SOURCE_CONFIG}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, body in TOKENIZER_FILES.items():
        (path / name).write_bytes(body)
    return config


def _train_one_step(eng, seed=0):
    rng = np.random.default_rng(seed)
    eng.train_step(rng.integers(0, ODD.vocab_size, (eng.seqs_per_step, 65)))


def _step_dir(run):
    return run / sorted(p.name for p in run.iterdir() if p.name.startswith("step_"))[-1]


@pytest.fixture
def trained_run(tmp_path):
    """A checkpoint of one step trained from a Hugging Face directory that is then moved away."""
    _hf_source(tmp_path / "src")
    with _engine(str(tmp_path / "src")) as eng:
        _train_one_step(eng)
        eng.save_checkpoint(tmp_path / "run")
    shutil.move(tmp_path / "src", tmp_path / "moved")
    return tmp_path / "run"


def test_export_of_a_run_trained_from_hf_keeps_tokenizer_and_config(trained_run, tmp_path,
                                                                     capsys):
    """The export holds the source's tokenizer files and generation config byte for byte and
    its bos/eos ids, max_position_embeddings and architectures, though the source moved; the
    one summary line names the architecture, layers, files and the dtype change."""
    out = tmp_path / "hf"
    assert main([str(trained_run), str(out)]) == 0
    for name, body in TOKENIZER_FILES.items():
        assert (out / name).read_bytes() == body, name
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in SOURCE_CONFIG} == {**SOURCE_CONFIG, "torch_dtype": "bfloat16"}
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"dataflow-export: wrote LlamaForCausalLM (3 layers, ")
    assert str(out) in line and "tokenizer.json" in line and "model.safetensors" in line
    assert "torch_dtype float32 -> bfloat16" in line and "no tokenizer" not in line


def test_qwen3_export_keeps_its_family_and_context_length(tmp_path, capsys):
    """A Qwen3 source exports as Qwen3ForCausalLM with its own max_position_embeddings (512
    stays 512), and the summary line names Qwen3ForCausalLM."""
    _hf_source(tmp_path / "src", QWEN3)
    with _engine(str(tmp_path / "src")) as eng:
        eng.save_checkpoint(tmp_path / "run")
    capsys.readouterr()
    assert main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["max_position_embeddings"] == 512 and cfg["bos_token_id"] == 1
    assert "wrote Qwen3ForCausalLM (3 layers" in capsys.readouterr().err


def test_resumed_run_keeps_the_source_in_its_next_checkpoint(trained_run, tmp_path):
    """A run resumed from a checkpoint stores the same source files in its next checkpoint,
    so its export still carries the tokenizer."""
    with _engine(str(trained_run)) as eng:
        _train_one_step(eng, seed=1)
        eng.save_checkpoint(tmp_path / "run2")
    assert main([str(tmp_path / "run2"), str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "tokenizer.json").read_bytes() == TOKENIZER_FILES["tokenizer.json"]


def test_engine_save_pretrained_of_a_hf_model_copies_the_tokenizer(tmp_path):
    """Engine.save_pretrained of a model imported from a Hugging Face directory writes the
    same tokenizer files and config values as dataflow-export does."""
    _hf_source(tmp_path / "src")
    with _engine(str(tmp_path / "src")) as eng:
        eng.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == \
        TOKENIZER_FILES["generation_config.json"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512 and cfg["eos_token_id"] == 2


def test_zoo_model_export_says_there_is_no_tokenizer(tmp_path, capsys):
    """A zoo model's export writes config and weights only and says, on its summary line, that
    AutoTokenizer will not load it and why."""
    with Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
        eng.save_checkpoint(tmp_path / "run")
    assert main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json",
                                                                   "model.safetensors"]
    err = capsys.readouterr().err
    assert ("no tokenizer: tiny is a zoo model (byte-level ids when trained on text); "
            "AutoTokenizer will not load this directory") in err
    assert len(err.strip().splitlines()) == 1


def test_overwrite_refusal_names_the_cli_flag_or_the_python_keyword(trained_run, tmp_path,
                                                                    capsys):
    """An existing export is refused by dataflow-export naming --overwrite (exit 2, the old
    export untouched) and by save_pretrained naming overwrite=True; --overwrite replaces it."""
    out = tmp_path / "hf"
    assert main([str(trained_run), str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([str(trained_run), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and "overwrite=True" not in err
    assert str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(ConfigError, match="overwrite=True") as exc:
        save_pretrained(ODD, [], out)
    assert "--overwrite" not in str(exc.value)
    assert main([str(trained_run), str(out), "--overwrite"]) == 0


def test_export_refuses_a_directory_that_is_not_a_model_and_writes_nothing(trained_run,
                                                                           tmp_path, capsys):
    """A non-empty directory that is not a Hugging Face model is refused even with
    --overwrite: exit 2, one line naming it, its files untouched."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert main([str(trained_run), str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(out) in err and "not a Hugging Face" in err
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_failed_export_leaves_no_directory_behind(trained_run, tmp_path, capsys):
    """A checkpoint whose block fails its checksum mid-export exits 2 and leaves neither
    OUT_DIR, nor a hidden temporary, nor the parent directories the export made."""
    block = _step_dir(trained_run) / "layer_001.bin"
    data = bytearray(block.read_bytes())
    data[10] ^= 0xFF
    block.write_bytes(bytes(data))
    assert main([str(trained_run), str(tmp_path / "a" / "b" / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layer_001.bin" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()



def test_tampered_source_file_in_a_checkpoint_is_refused_naming_it(trained_run, tmp_path,
                                                                   capsys):
    """A checkpoint whose stored tokenizer fails its sha256 exits 2 naming the file, and no
    export is written."""
    tok = _step_dir(trained_run) / "source" / "tokenizer.json"
    body = bytearray(tok.read_bytes())
    body[3] ^= 0x01
    tok.write_bytes(bytes(body))
    assert main([str(trained_run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "source/tokenizer.json" in err
    assert not (tmp_path / "hf").exists()


def test_export_to_a_file_is_refused_naming_it(trained_run, tmp_path, capsys):
    """OUT_DIR that is a file: exit 2, one line naming it, the file untouched."""
    out = tmp_path / "a_file"
    out.write_text("x")
    assert main([str(trained_run), str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "is a file" in err
    assert out.read_text() == "x"


def test_export_loads_with_transformers_autotokenizer(trained_run, tmp_path):
    """transformers' AutoTokenizer loads the export: the source's tokens and special ids."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main([str(trained_run), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok("hello world").input_ids[-2:] == [3, 4]
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.max_new_tokens) == (2, 7)


def test_export_generates_with_transformers_automodel(trained_run, tmp_path):
    """AutoModelForCausalLM loads the export (512-token context kept) and generates from the
    tokenizer's ids."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    out = tmp_path / "hf"
    assert main([str(trained_run), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("hello world", return_tensors="pt").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.max_position_embeddings == 512
    got = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert got.shape[1] > ids.shape[1]
