"""A tokenizer that prepends a space to every input (Llama 2's and Mistral's SentencePiece style,
here a Metaspace BPE trained on the fly with the `tokenizers` library) would give other ids at
each cut of a long text file into pieces: such a tokenizer is found out (Tokenizer.cuts_cleanly,
by trying the cut on probe texts), its text files are tokenised whole, and the ids are exactly
encoding each file at once; the byte-level BPE keeps its parallel pieces. The cache key tells
the two apart, so a corpus an older version cut is tokenised again."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.data import records
from dataflow.data.records import FileSlice, plan_slices
from dataflow.data.shipped import shipped_text_path
from dataflow.data.tokenise import tokenise
from dataflow.data.tokenizer import load_tokenizer
from tests.data.tokenizer_fixture import (  # noqa: F401 (fixtures are used by name)
    EOS, IM_END, SPECIALS, bpe_dir, corpus_words, random_sentence, write_tokenizer_config)


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """A BPE with SentencePiece's Metaspace pre-tokeniser (spaces become '▁', one prepended to
    the input's first word), as Llama 2's tokenizer.json has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIALS),
                                  show_progress=False)
    tok.train([str(shipped_text_path())], trainer)
    folder = tmp_path_factory.mktemp("metaspace")
    tok.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder, None)
    return folder


def _big_text(rng) -> str:
    words = [w for w in corpus_words() if w.isascii()]
    return "\n".join(random_sentence(rng, words, 1, 12) for _ in range(700)) + "\n"


def test_a_prepending_tokenizer_is_found_out_and_a_byte_level_one_is_not(metaspace_dir,
                                                                          bpe_dir):
    assert load_tokenizer(metaspace_dir).cuts_cleanly is False
    assert load_tokenizer(bpe_dir).cuts_cleanly is True


def test_its_long_text_files_give_the_ids_of_encoding_them_whole(metaspace_dir, bpe_dir,
                                                                  tmp_path, rng, monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.setattr(records, "PIECE_CHARS", 2000)
    text = _big_text(rng)
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    lib = Tokenizer.from_file(str(metaspace_dir / "tokenizer.json"))
    cut = [i for p in records.read_records([path])
           for i in lib.encode(p.text, add_special_tokens=False).ids]
    whole = lib.encode(text).ids
    assert cut != whole  # the trap this guards against is real for this tokenizer
    slices = list(plan_slices([path], 1 << 18, cut_text=False))
    assert slices == [FileSlice(path, "text", 0, path.stat().st_size, 1)]
    tok = load_tokenizer(metaspace_dir)
    corpus = tokenise(path, tok, cache_dir=tmp_path / "cache", progress=False, jobs=2)
    tokens = np.array(corpus.arrays()[0])
    assert np.array_equal(tokens, whole + [lib.token_to_id(IM_END)])
    # the byte-level BPE still cuts (and still matches), under another key
    byte_level = tokenise(path, load_tokenizer(bpe_dir), cache_dir=tmp_path / "cache",
                          progress=False)
    assert byte_level.key != corpus.key
