"""bench.chat_template_check (our chat rendering, ids and assistant mask against transformers')
and the synthetic inputs of bench.chat_data. The comparison needs transformers (skipped without
it, as in CI); its refusal without transformers and the tokenizer recipe shared with the chat
example are checked always (the recipe needs the tokenizers library)."""

from __future__ import annotations

import json
import sys

import pytest


def test_our_chat_rendering_ids_and_mask_agree_with_transformers_on_50_conversations(tmp_path):
    """For each template (ChatML, ChatML with generation tags, Llama-3 style, Qwen3 style): text
    and ids of all 50 random conversations equal apply_chat_template's, and the learn flags
    equal its assistant_masks."""
    pytest.importorskip("transformers")
    from dataflow.bench.chat_template_check import main

    out = tmp_path / "check.json"
    assert main(["--conversations", "50", "--seed", "3", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["agree"] and [r["template"] for r in rec["results"]] == [
        "chatml", "chatml-generation", "llama3", "qwen3"]
    for r in rec["results"]:
        assert r["text_agree"] == r["ids_agree"] == 50 and r["mask_agree"] in (None, 50), r
        assert 0 < r["learnt"] < r["tokens"]


def test_chat_template_check_exits_2_naming_transformers_when_it_is_missing(monkeypatch, capsys):
    """Without transformers: exit 2 and one line saying what to install."""
    from dataflow.bench.chat_template_check import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["--conversations", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install transformers" in err


def test_bench_tokenizer_is_byte_identical_to_the_chat_examples(tmp_path):
    """bench.chat_data.train_tokenizer and examples/chat_finetune.py train the same BPE."""
    pytest.importorskip("tokenizers")
    from dataflow.bench.chat_data import train_tokenizer
    from examples.chat_finetune import train_tokenizer as example_tokenizer

    assert train_tokenizer().to_str() == example_tokenizer().to_str()
