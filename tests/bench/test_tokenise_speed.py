"""bench.tokenise_speed's parts on small corpora (the timed runs themselves are for the bench
machines): the three corpora tokenise into what their kind says, and the default worker counts
run from 1 to every core."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


def test_small_synthetic_corpora_tokenise_as_text_records_and_masked_chats(tmp_path):
    """Text (2 files), JSONL text and chat corpora of a few hundred kB: every token of text is
    learnt, a chat corpus learns some but not all, and the run's numbers add up."""
    from dataflow.bench.chat_data import write_tokenizer_dir
    from dataflow.bench.tokenise_speed import default_jobs, make_corpora, time_tokenise
    from dataflow.data.tokenizer import load_tokenizer

    tok = load_tokenizer(write_tokenizer_dir(tmp_path / "tok", "chatml"))
    corpora = make_corpora(tmp_path / "data", {"text_mb": 0.2, "jsonl_mb": 0.2,
                                               "chat_records": 200, "text_files": 2}, seed=1)
    runs = {kind: time_tokenise(path, tok, 1, tmp_path) for kind, path in corpora.items()}
    assert runs["text"]["records"] == 2 and runs["chat"]["records"] == 200
    assert runs["text"]["learnt"] == runs["text"]["tokens"]
    assert runs["jsonl"]["learnt"] == runs["jsonl"]["tokens"] and runs["jsonl"]["records"] > 10
    assert 0 < runs["chat"]["learnt"] < runs["chat"]["tokens"]
    assert all(r["mb_per_s"] > 0 and not r["parallel"] for r in runs.values())
    assert default_jobs(16) == [1, 2, 4, 8, 16] and default_jobs(6) == [1, 2, 4, 6]
    assert default_jobs(1) == [1]
