"""A tokenizer sent to tokenising workers: each unit of work carries a pickled Tokenizer, and a
worker loads the tokenizer.json once, not once per unit (a 150k-id tokenizer.json takes about
0.6 s to load, longer than a unit takes to encode)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

pytest.importorskip("tokenizers")


def test_a_tokenizer_unpickled_for_every_unit_is_loaded_once_per_process(tmp_path, monkeypatch):
    """Five unpickled copies load the file once and encode as the original; a copy of another
    digest (the file changed) loads it again."""
    from dataflow.bench.chat_data import write_tokenizer_dir
    from dataflow.data import tokenizer as tokenizer_module

    tok = tokenizer_module.load_tokenizer(write_tokenizer_dir(tmp_path / "tok", "chatml"))
    loads = []
    real = tokenizer_module._load_library_tokenizer
    monkeypatch.setattr(tokenizer_module, "_load_library_tokenizer",
                        lambda file: loads.append(file) or real(file))
    tokenizer_module._process_tokenizer.cache_clear()
    copies = [pickle.loads(pickle.dumps(tok)) for _ in range(5)]
    assert len(loads) == 1
    text = "Alice was beginning to get very tired<|im_end|>"
    assert all(c.encode(text, special=False)[0].tolist() ==
               tok.encode(text, special=False)[0].tolist() for c in copies)
    changed = pickle.loads(pickle.dumps(tok))
    changed.__setstate__({"info": dataclasses.replace(tok.info, digest="another")})
    assert len(loads) == 2 and changed.info.digest == "another"
