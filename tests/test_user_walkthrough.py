"""The README's fine-tune walk-through on a model transformers itself wrote (skipped without
transformers, torch and tokenizers): plan, sweep --predict-only, dataflow-data (the text
tokenised with the model's own tokenizer), train on it with checkpoints, resume, export, and the
export reloaded by AutoTokenizer and AutoModelForCausalLM with the source's generation config
and special token ids kept."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    if ok:
        assert res.returncode == 0, res.stderr[-2000:]
    return res


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A 2-layer Llama and its WordLevel tokenizer, saved by transformers (bos 1, eos 2, a
    generation config of its own, max_position_embeddings 512)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("user") / "my-model"
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           "<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2,
                                                            max_new_tokens=7)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_walkthrough_from_plan_to_a_reloaded_export(hf_model, tmp_path):
    """Every step of the README's walk-through works on the directory transformers wrote."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    plan = _run("dataflow.cli.plan", "2", "0.25", "64", str(hf_model), "--gpu", "cpu", "--json")
    assert json.loads(plan.stdout)["model"]["n_layers"] == 2
    _run("dataflow.cli.sweep", "run", "--predict-only", "--gpu", "cpu", "--model", str(hf_model),
         "--seqlen", "64", "--host", "2", "--dev", "0.25", "--out", str(tmp_path / "sweep"))

    # step 2: dataflow-data tokenises the text with the model's own tokenizer (no ids by hand)
    tok = Tokenizer.from_file(str(hf_model / "tokenizer.json"))
    rng = np.random.default_rng(0)
    text = "\n\n".join(" ".join(f"w{i}" for i in rng.integers(0, 125, 200)) for _ in range(8))
    (tmp_path / "train.txt").write_text(text)
    report = json.loads(_run("dataflow.cli.data", str(hf_model), str(tmp_path / "train.txt"),
                             "--seqlen", "64", "--json").stdout)
    assert report["tokenizer"] == str(hf_model / "tokenizer.json") and not report["cached"]
    ids = np.load(Path(report["corpus"]) / "tokens.npy").tolist()
    assert ids == tok.encode(text).ids + [2]  # one document, ended by the eos token </s>

    run = tmp_path / "runs" / "ft"
    common = ["2", "0.25", "64", str(hf_model), "--backend", "numpy", "--data",
              str(tmp_path / "train.txt"), "--steps", "3", "--lr", "1e-3",
              "--checkpoint-dir", str(run), "--save-every", "1"]
    _run("dataflow.cli.demo", *common)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_"))
    _run("dataflow.cli.demo", *common, "--resume")  # already at step 3: resumes and ends

    out = tmp_path / "hf-out"
    _run("dataflow.cli.export", str(run), str(out))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("w3 w4").input_ids == AutoTokenizer.from_pretrained(hf_model)("w3 w4").input_ids
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.max_new_tokens) == (1, 2, 7)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 512)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    generated = model.generate(**tokenizer("w3 w4", return_tensors="pt"), do_sample=False)
    assert generated.shape[1] > 2
