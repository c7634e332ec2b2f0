"""The data path with a real tokenizer (a byte-level BPE trained on the fly, ChatML template):
text, folders, JSONL, Parquet/Arrow become exactly the library's own ids with EOS at each
document end; chat records become exactly the ids of their rendering, learning only the
assistant's turns; the packer's rows keep documents apart, never split a chat record, and make
every text token a target once per epoch; the cache re-tokenises when, and only when, the data
or tokenizer changed, and leaves nothing behind on failure; bad input is refused naming the
file and line; a run resumes bit for bit; dataflow-data reports what it tokenised."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dataflow.batch import make_batch, round_chunks
from dataflow.cli.data import main as data_main
from dataflow.cli.demo import main as demo_main
from dataflow.data import records, tokenise as tokenise_mod
from dataflow.data.chat import ChatTemplate
from dataflow.data.packed import PackedCorpus
from dataflow.data.records import Fields
from dataflow.data.tokenise import Corpus, tokenise
from dataflow.data.tokenizer import choose_tokenizer, load_tokenizer
from dataflow.kernels.reference import IGNORE
from dataflow.memplan.plan.plan import Chunking
from dataflow.models.errors import ConfigError
from tests.data.tokenizer_fixture import (  # noqa: F401 (fixtures are used by name)
    CHATML_TEMPLATE, DEFAULT_SYSTEM, IM_END, RAISING_TEMPLATE, bpe_dir, corpus_words,
    gen_bpe_dir, hf_llama_dir, random_conversation, random_sentence, render_chatml,
    tokenizer_copy, train_bpe, write_chat_jsonl, write_tokenizer_config)


# -- helpers ----------------------------------------------------------------------------------
def _lib(folder: Path):
    """The tokenizers library's own Tokenizer of folder/tokenizer.json (the reference)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _arrays(corpus: Corpus):
    return tuple(np.array(a) for a in corpus.arrays())


def _text(rng, words, n_lines: int) -> str:
    return "\n".join(random_sentence(rng, words, 1, 14) for _ in range(n_lines)) + "\n"


def _tok(folder: Path):
    return load_tokenizer(folder)


def _tokenise(data, folder_or_tok, cache, **kw) -> Corpus:
    tok = load_tokenizer(folder_or_tok) if isinstance(folder_or_tok, Path) else folder_or_tok
    return tokenise(data, tok, cache_dir=cache, progress=False, **kw)


def _expected_text(lib, texts: list[str]):
    """tokens and starts of documents `texts`, each the library's ids then EOS."""
    eos = lib.token_to_id(IM_END)
    ids, starts = [], [0]
    for t in texts:
        ids += lib.encode(t).ids + [eos]
        starts.append(len(ids))
    return np.asarray(ids), np.asarray(starts)


def _check_text_corpus(corpus: Corpus, lib, texts: list[str]) -> None:
    tokens, learn, starts, chat = _arrays(corpus)
    want, want_starts = _expected_text(lib, texts)
    assert np.array_equal(tokens, want)
    assert np.array_equal(starts, want_starts)
    assert learn.dtype == np.uint8 and np.all(learn == 1)
    assert np.array_equal(chat, np.zeros(len(texts)))
    assert corpus.summary.records == len(texts) and corpus.summary.tokens == want.size


# -- text: the library's own ids, EOS at each document's end ------------------------------------
def test_text_file_is_the_librarys_ids_then_eos(bpe_dir, tmp_path, rng):
    """A text file is one document: exactly Tokenizer.encode(text).ids, then the EOS id, every
    token learnt."""
    text = _text(rng, corpus_words(), 60)
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    corpus = _tokenise(tmp_path / "doc.txt", bpe_dir, tmp_path / "cache")
    _check_text_corpus(corpus, _lib(bpe_dir), [text])
    assert not corpus.cached and corpus.summary.chat_records == 0


def test_folder_of_text_files_is_tokenised_in_sorted_path_order(bpe_dir, tmp_path, rng):
    """A folder (walked recursively, hidden entries skipped) is its files' documents in sorted
    path order, each ending with EOS."""
    words, data = corpus_words(), tmp_path / "data"
    names = ["b.txt", "a/z.md", "a/b/c.text", "c.txt", "0.txt"]
    texts = {}
    for name in names:
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        texts[name] = _text(rng, words, int(rng.integers(1, 12)))
        (data / name).write_text(texts[name], encoding="utf-8")
    (data / ".hidden").mkdir()
    (data / ".hidden" / "x.txt").write_text("never read")
    (data / ".skip.txt").write_text("never read")
    (data / "notes.csv").write_text("not a data file")
    order = ["0.txt", "a/b/c.text", "a/z.md", "b.txt", "c.txt"]
    corpus = _tokenise(data, bpe_dir, tmp_path / "cache")
    _check_text_corpus(corpus, _lib(bpe_dir), [texts[n] for n in order])


def test_jsonl_text_records_are_each_a_document(bpe_dir, tmp_path, rng):
    """Each JSONL record's text field (named by Fields) is a document of the library's ids plus
    EOS; other fields are ignored; an empty text is no document at all; blank lines skip."""
    words = corpus_words()
    texts = [random_sentence(rng, words, 1, 40) for _ in range(25)]
    lines = [json.dumps({"id": i, "body": t, "meta": {"x": 1}}, ensure_ascii=False)
             for i, t in enumerate(texts)]
    lines.insert(7, json.dumps({"body": ""}))
    lines.insert(3, "   ")
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = _tokenise(tmp_path / "d.jsonl", bpe_dir, tmp_path / "cache",
                       fields=Fields(text="body"))
    _check_text_corpus(corpus, _lib(bpe_dir), texts)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_table_text_column_is_each_row_a_document(kind, bpe_dir, tmp_path, rng):
    """A Parquet (several row groups) or Arrow file's text column: each row a document of the
    library's ids plus EOS; a null row is no document."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = corpus_words()
    texts = [random_sentence(rng, words, 1, 40) for _ in range(30)]
    column = texts[:10] + [None] + texts[10:]
    table = pa.table({"text": column, "n": list(range(len(column)))})
    path = tmp_path / f"d.{kind}"
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=7)
    else:
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)
    corpus = _tokenise(path, bpe_dir, tmp_path / "cache")
    _check_text_corpus(corpus, _lib(bpe_dir), texts)


def test_text_file_longer_than_a_piece_gives_the_ids_of_encoding_it_whole(bpe_dir, tmp_path,
                                                                         rng, monkeypatch):
    """A text file read in pieces (PIECE_CHARS 2000, the file ~25x that) is still one document
    with exactly the ids of encoding the whole file: the byte-level BPE never merges across a
    newline that a letter follows."""
    monkeypatch.setattr(records, "PIECE_CHARS", 2000)
    text = _text(rng, corpus_words(), 900)
    assert len(text) > 20 * 2000
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(records.read_records([path]))
    assert len(pieces) >= 10 and all(p.continues for p in pieces[1:])
    assert "".join(p.text for p in pieces) == text
    corpus = _tokenise(path, bpe_dir, tmp_path / "cache")
    _check_text_corpus(corpus, _lib(bpe_dir), [text])


# -- chat: the rendering's ids, the assistant's turns learnt ------------------------------------
def _expected_chat(lib, convs):
    """(tokens, learn, starts) of chat records from the hand-written ChatML rendering: a token
    is learnt when its characters overlap an assistant turn's `content<|im_end|>\\n`."""
    ids, learn, starts = [], [], [0]
    for conv in convs:
        text, spans = render_chatml(conv)
        enc = lib.encode(text, add_special_tokens=False)
        inside = np.zeros(len(text) + 1, bool)
        for a, b in spans:
            inside[a:b] = True
        ids += enc.ids
        learn += [bool(inside[a:b].any()) for a, b in enc.offsets]
        starts.append(len(ids))
    return np.asarray(ids), np.asarray(learn, np.uint8), np.asarray(starts)


def test_chat_records_are_the_rendering_ids_learning_only_assistant_turns(bpe_dir, tmp_path,
                                                                         rng):
    """Chat JSONL (system/user/assistant, every third with two assistant turns, some without a
    system turn): tokens are exactly encode(rendered, add_special_tokens=False) of the ChatML
    rendering written out by hand; learnt tokens are exactly those of each assistant turn's
    content and end, which are the ids of encoding that turn's own text; no EOS is added."""
    convs = write_chat_jsonl(tmp_path / "chat.jsonl", rng, 40)
    assert sum(sum(m["role"] == "assistant" for m in c) == 2 for c in convs) >= 10
    lib = _lib(bpe_dir)
    corpus = _tokenise(tmp_path / "chat.jsonl", bpe_dir, tmp_path / "cache")
    tokens, learn, starts, chat = _arrays(corpus)
    want_tokens, want_learn, want_starts = _expected_chat(lib, convs)
    assert np.array_equal(tokens, want_tokens)
    assert np.array_equal(starts, want_starts)
    assert np.array_equal(learn, want_learn)
    assert np.all(chat == 1) and corpus.summary.chat_records == 40
    for r, conv in enumerate(convs):  # the learnt ids are the assistant turns' own encodings
        turns = [lib.encode(m["content"] + IM_END + "\n", add_special_tokens=False).ids
                 for m in conv if m["role"] == "assistant"]
        seg = slice(starts[r], starts[r + 1])
        assert tokens[seg][learn[seg] == 1].tolist() == sum(turns, [])
    assert corpus.summary.learnt == int(want_learn.sum())
    assert corpus.summary.masked_share == pytest.approx(1 - want_learn.mean())


def test_generation_tag_template_learns_the_same_tokens_as_the_plain_one(bpe_dir, gen_bpe_dir,
                                                                        tmp_path, rng):
    """The {% generation %} variant of the template marks the assistant turns itself: the same
    rendering, spans and corpus (tokens and learn flags bit for bit) as the plain template's
    prefix rule."""
    convs = write_chat_jsonl(tmp_path / "chat.jsonl", rng, 30, two_turns_every=2)
    plain, gen = _tok(bpe_dir), _tok(gen_bpe_dir)
    for conv in convs[:10]:
        a = ChatTemplate(plain.info.chat_template, plain.info.special_tokens,
                         plain.added_tokens()).render_with_spans(conv)
        b = ChatTemplate(gen.info.chat_template, gen.info.special_tokens,
                         gen.added_tokens()).render_with_spans(conv)
        assert a == b == render_chatml(conv)
    one = _tokenise(tmp_path / "chat.jsonl", plain, tmp_path / "c1")
    two = _tokenise(tmp_path / "chat.jsonl", gen, tmp_path / "c2")
    assert one.key != two.key
    for x, y in zip(_arrays(one), _arrays(two)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("which", ["plain", "generation"])
def test_conversation_opening_with_the_assistant_learns_only_its_turns(which, bpe_dir,
                                                                      gen_bpe_dir, tmp_path,
                                                                      rng):
    """A conversation whose first message is the assistant's (a greeting), with the template's
    default system turn before it: only the assistant turns' content and end are learnt, not
    the system turn and header the template writes first, under either template."""
    words = corpus_words()
    convs = []
    for _ in range(8):
        conv = [m for m in random_conversation(rng, words, turns=2) if m["role"] != "system"]
        convs.append(conv[1:])  # assistant, user, assistant
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                              for c in convs))
    corpus = _tokenise(tmp_path / "c.jsonl", bpe_dir if which == "plain" else gen_bpe_dir,
                       tmp_path / "cache")
    tokens, learn, _, _ = _arrays(corpus)
    want_tokens, want_learn, _ = _expected_chat(_lib(bpe_dir), convs)
    assert np.array_equal(tokens, want_tokens)
    assert np.array_equal(learn, want_learn)


def test_chat_template_jinja_and_the_chat_template_flag_take_precedence(bpe_dir, gen_bpe_dir,
                                                                        tmp_path, rng):
    """chat_template.jinja beside tokenizer.json is used instead of tokenizer_config.json's
    template (as transformers reads it); --chat-template FILE (DataOptions.chat_template) is
    used instead of either; an unreadable FILE is refused naming it."""
    from dataflow.data.open_data import DataOptions, tokenise_data

    convs = write_chat_jsonl(tmp_path / "chat.jsonl", rng, 10)
    want = _expected_chat(_lib(bpe_dir), convs)
    brief = CHATML_TEMPLATE.replace(DEFAULT_SYSTEM, "Be brief.")
    jinja_dir = tokenizer_copy(bpe_dir, tmp_path / "jinja", CHATML_TEMPLATE)
    (jinja_dir / "chat_template.jinja").write_text(brief)
    assert _tok(jinja_dir).info.chat_template == brief
    got = _arrays(_tokenise(tmp_path / "chat.jsonl", jinja_dir, tmp_path / "c1"))
    lib = _lib(bpe_dir)
    brief_ids = sum((lib.encode(render_chatml(c, "Be brief.")[0], add_special_tokens=False).ids
                     for c in convs), [])
    assert got[0].tolist() == brief_ids
    (tmp_path / "gen.jinja").write_text(_tok(gen_bpe_dir).info.chat_template)
    flagged = tokenise_data(tmp_path / "chat.jsonl", _tok(jinja_dir),
                            DataOptions(chat_template=str(tmp_path / "gen.jinja"),
                                        cache_dir=str(tmp_path / "c2")), progress=False)
    for x, y in zip(_arrays(flagged)[:3], want):
        assert np.array_equal(x, y)
    with pytest.raises(ConfigError, match=f"--chat-template {tmp_path / 'none.jinja'}"):
        tokenise_data(tmp_path / "chat.jsonl", _tok(jinja_dir),
                      DataOptions(chat_template=str(tmp_path / "none.jinja")), progress=False)


# -- packing ----------------------------------------------------------------------------------
def _mixed_folder(tmp_path, rng) -> Path:
    """chat.jsonl (25 short conversations), long.jsonl (5 of two long exchanges: longer than a
    row of 129) and text.jsonl (20 documents of 1..200 words)."""
    data = tmp_path / "mixed"
    data.mkdir()
    write_chat_jsonl(data / "chat.jsonl", rng, 25, two_turns_every=5, hi=3)
    write_chat_jsonl(data / "long.jsonl", rng, 5, two_turns_every=1, lo=25, hi=40)
    words = corpus_words()
    with open(data / "text.jsonl", "w", encoding="utf-8") as f:
        for _ in range(20):
            f.write(json.dumps({"text": random_sentence(rng, words, 1, 200)}) + "\n")
    return data


def _tagged(corpus: Corpus, where: Path) -> Corpus:
    """A copy of corpus whose token at corpus position p is p + 1 (uint32): every packed column
    names where it came from (0 is padding); learn, starts and chat are the corpus's own."""
    shutil.copytree(corpus.path, where)
    n = int(np.load(corpus.path / "starts.npy")[-1])
    np.save(where / "tokens.npy", np.arange(1, n + 1, dtype=np.uint32))
    return Corpus(where, corpus.key, corpus.summary, corpus.tokenizer, corpus.cached)


def _runs(rows, starts):
    """Per row, its maximal runs of one doc id: (row, first col, record or None for padding,
    corpus positions), asserting a run is consecutive positions of one record."""
    out = []
    tok, doc = rows.tokens, rows.doc_ids
    for i in range(tok.shape[0]):
        cuts = [0] + [j for j in range(1, tok.shape[1]) if doc[i, j] != doc[i, j - 1]] + \
            [tok.shape[1]]
        for a, b in zip(cuts, cuts[1:]):
            t = tok[i, a:b].astype(np.int64)
            if np.all(t == 0):
                assert b == tok.shape[1], "padding only ends a row"
                out.append((i, a, None, None))
                continue
            pos = t - 1
            rec = int(np.searchsorted(starts, pos[0], side="right") - 1)
            assert np.array_equal(pos, np.arange(pos[0], pos[0] + b - a)), "one run, one slice"
            assert pos[-1] < starts[rec + 1], "a run never crosses into the next record"
            out.append((i, a, rec, pos))
    return out


def _check_rows(rows, starts, learn, chat, L):
    """The packing invariants of one batch of tagged rows (see the tests' docstrings)."""
    runs = _runs(rows, starts)
    for i, a, rec, pos in runs:
        lab = rows.labels[i, a:a + (0 if pos is None else pos.size)]
        if rec is None:
            assert np.all(rows.labels[i, a:] == IGNORE) and np.all(rows.tokens[i, a:] == 0)
            continue
        if a > 0:
            assert pos[0] == starts[rec], "a document id changes only at a record's start"
        want = np.where((learn[pos] == 1) & (pos != starts[rec]), pos + 1, IGNORE)
        assert np.array_equal(lab, want), "labels: the token where learnt, -100 elsewhere"
        length = starts[rec + 1] - starts[rec]
        if chat[rec]:
            assert pos[0] == starts[rec] and pos.size == min(length, L), "chat kept whole"
            assert length <= L or a == 0, "a chat record longer than a row starts one"
        elif pos[-1] != starts[rec + 1] - 1:
            assert a + pos.size == L, "an unfinished text document fills its row"
    return runs


def _pack_epochs(pc, L, starts, learn, chat, n_epochs, rows_per_batch=3):
    """Batches until the packer is `n_epochs` epochs in; the runs of all of them."""
    runs, batches = [], []
    while pc.state()["epoch"] < n_epochs:
        b = pc.next_batch(rows_per_batch)
        batches.append(b)
        base = sum(x.tokens.shape[0] for x in batches[:-1])
        runs += [(base + i, a, r, p) for i, a, r, p in _check_rows(b, starts, learn, chat, L)]
    return runs, batches


def _records_in_order(runs, starts, chat, L):
    """The records in the order rows hold them, a text continuation (a row's first run, on the
    token the row before ended on in its last column) joined to its record."""
    seq, prev = [], None
    for i, a, rec, pos in runs:
        if rec is not None:
            if (a == 0 and prev is not None and prev[2] == rec and not chat[rec]
                    and prev[0] == i - 1 and prev[1] + prev[3].size == L
                    and pos[0] == prev[3][-1]):
                # (a document whose first token fell in a row's last column starts again here)
                seq[-1][1].append((i, a, pos))
            else:
                assert pos[0] == starts[rec], "a run inside a record continues the row before"
                seq.append((rec, [(i, a, pos)]))
        prev = (i, a, rec, pos)
    return seq


def test_packed_rows_keep_records_apart_and_learn_each_text_token_once_per_epoch(
        bpe_dir, tmp_path, rng):
    """Rows of a tokenised chat + text corpus (positions tagged into the tokens): doc ids change
    exactly at record starts (and where padding begins); labels are -100 at every record's first
    token and wherever learn is 0, else the token; a chat record sits whole in one row (or, when
    longer than a row, cut at the row's end in a row of its own); a text document continues
    into the next row on the token its row ended on; each epoch holds every record once, and
    every learnt token but a record's first is a target exactly once; the untagged corpus packs
    the same ids."""
    corpus = _tokenise(_mixed_folder(tmp_path, rng), bpe_dir, tmp_path / "cache")
    tokens, learn, starts, chat = _arrays(corpus)
    seqlen = 128
    L = seqlen + 1
    lengths = np.diff(starts)
    assert (lengths[chat == 1] > L).sum() >= 5 and (lengths[chat == 1] <= L // 2).any()
    assert (lengths[chat == 0] > 2 * L).any()
    tagged = _tagged(corpus, tmp_path / "tagged")
    seed = int(rng.integers(1 << 30))
    pc = PackedCorpus(tagged, seqlen, seed=seed)
    assert pc.too_long_records == int(((np.diff(starts) > L) & (chat == 1)).sum())
    runs, batches = _pack_epochs(pc, L, starts, learn, chat, 2)
    labels = np.concatenate([b.labels for b in batches])
    assert any(rec is None for _, _, rec, _ in runs), "some rows end in padding"
    assert any(a > 0 and chat[rec] for _, a, rec, _ in runs if rec is not None)
    seq = _records_in_order(runs, starts, chat, L)
    trained = [r for r in range(starts.size - 1) if not _silent(r, starts, learn, chat, L)]
    assert pc.silent_records == starts.size - 1 - len(trained)
    n = len(trained)
    for epoch in range(2):
        ep = seq[epoch * n:(epoch + 1) * n]
        assert sorted(r for r, _ in ep) == trained, "each record once per epoch"
        targets = []
        for rec, parts in ep:
            held = np.unique(np.concatenate([pos for _, _, pos in parts]))
            end = min(starts[rec + 1], starts[rec] + L) if chat[rec] else starts[rec + 1]
            assert np.array_equal(held, np.arange(starts[rec], end)), "a record, in order"
            assert len(parts) == 1 or not chat[rec], "a chat record never spans rows"
            for i, a, pos in parts:
                lab = labels[i, a:a + pos.size].copy()
                if a == 0:
                    lab[0] = IGNORE  # column 0 is an input only, never a target
                targets.append(pos[lab != IGNORE])
        want = np.concatenate([np.arange(starts[r] + 1, min(starts[r + 1], starts[r] + L))
                               if chat[r] else np.arange(starts[r] + 1, starts[r + 1])
                               for r in trained])
        want = want[learn[want] == 1]
        assert np.array_equal(np.sort(np.concatenate(targets)), want), \
            "every learnt token but a record's first is a target once per epoch"
    assert [r for r, _ in seq[:n]] != [r for r, _ in seq[n:2 * n]], "reshuffled each epoch"
    plain = PackedCorpus(corpus, seqlen, seed=seed, pad_id=0)
    for b in batches:
        p = plain.next_batch(b.tokens.shape[0])
        real = np.where(b.tokens > 0, tokens.astype(np.int32)[np.maximum(b.tokens, 1) - 1], 0)
        assert np.array_equal(p.tokens, real)
        assert np.array_equal(p.labels, np.where(b.labels == IGNORE, IGNORE, real))
        assert np.array_equal(p.doc_ids, b.doc_ids)
        assert p.tokens.dtype == p.labels.dtype == p.doc_ids.dtype == np.int32


def test_too_long_chat_records_are_cut_to_the_row_or_dropped_and_counted(bpe_dir, tmp_path,
                                                                         rng):
    """Chat records longer than a row: counted (too_long_records) under either policy, as the
    library's ids of their renderings say; 'truncate' puts each in a row of its own as its first
    seqlen + 1 ids; 'drop' never packs them, and every other record still comes once per epoch;
    with nothing left to train on, the refusal names --too-long."""
    convs = write_chat_jsonl(tmp_path / "chat.jsonl", rng, 16, two_turns_every=2, hi=12)
    lib = _lib(bpe_dir)
    ids = [lib.encode(render_chatml(c)[0], add_special_tokens=False).ids for c in convs]
    seqlen = int(np.median([len(x) for x in ids]))  # about half the records are longer
    L = seqlen + 1
    long = {r for r, x in enumerate(ids) if len(x) > L}
    assert 0 < len(long) < len(convs)
    corpus = _tokenise(tmp_path / "chat.jsonl", bpe_dir, tmp_path / "cache")
    tokens, learn, starts, chat = _arrays(corpus)
    tagged = _tagged(corpus, tmp_path / "tagged")
    for policy in ("truncate", "drop"):
        pc = PackedCorpus(tagged, seqlen, too_long=policy, seed=int(rng.integers(1 << 30)))
        assert pc.too_long_records == len(long)
        runs, _ = _pack_epochs(pc, L, starts, learn, chat, 1)
        seq = _records_in_order(runs, starts, chat, L)
        kept = sorted(set(range(len(convs))) - (long if policy == "drop" else set()))
        assert sorted(r for r, _ in seq[:len(kept)]) == kept
        for rec, [(i, a, pos)] in seq:
            assert tokens[pos].tolist() == ids[rec][:L]
            if rec in long:
                assert policy == "truncate" and a == 0 and pos.size == L
    with pytest.raises(ConfigError, match="no record left.*--too-long truncate"):
        PackedCorpus(tagged, 16, too_long="drop")
    with pytest.raises(ConfigError, match="too_long must be one of truncate, drop"):
        PackedCorpus(tagged, seqlen, too_long="cut")


@pytest.mark.parametrize("chunking", [
    Chunking(seqlen=64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_seq=1,
             chunks_per_round=2, rounds_per_step=2),
    Chunking(seqlen=128, chunk_tokens=32, seqs_per_chunk=1, chunks_per_seq=4,
             chunks_per_round=8, rounds_per_step=2),
    "engine"], ids=["packed-seqs", "split-seq", "engine-plan"])
def test_attention_segments_of_packed_rows_never_cross_a_record(chunking, bpe_dir,
                                                                 hf_llama_dir, tmp_path, rng):
    """Packed rows through make_batch(doc_ids=...) and round_chunks: every chunk's segments tile
    it, each segment's queries and keys lie in one record, its keys start at that record's first
    column (or its first in this sequence), targets are the labels shifted by one and positions
    restart at each record; for chunks holding several short sequences, sequences spanning
    chunks, and a real plan's chunking."""
    if chunking == "engine":
        from dataflow.engine import Engine

        with Engine(hf_llama_dir, host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
            chunking = eng.plan.chunking
    ch = chunking
    data = tmp_path / "short"
    data.mkdir()
    write_chat_jsonl(data / "chat.jsonl", rng, 20, two_turns_every=4, hi=3)
    words = corpus_words()
    (data / "text.jsonl").write_text("".join(
        json.dumps({"text": random_sentence(rng, words, 1, 15)}) + "\n" for _ in range(60)))
    corpus = _tokenise(data, bpe_dir, tmp_path / "cache")
    pc = PackedCorpus(corpus, ch.seqlen, seed=int(rng.integers(1 << 30)))
    crossings = 0
    for _ in range(6):
        rows = pc.next_batch(ch.seqs_per_step)
        b = make_batch(rows.tokens, rows.labels, doc_ids=rows.doc_ids, vocab_size=512,
                       rows=ch.seqs_per_step, seqlen=ch.seqlen)
        assert np.array_equal(b.targets, rows.labels[:, 1:])
        assert np.array_equal(b.ids, rows.tokens[:, :-1])
        doc = rows.doc_ids[:, :-1]
        first = np.array([[np.argmax(doc[r] == doc[r, c]) for c in range(ch.seqlen)]
                          for r in range(doc.shape[0])])
        assert np.array_equal(b.positions, np.arange(ch.seqlen) - first)
        crossings += int((doc[:, 1:] != doc[:, :-1]).sum())
        for rnd in range(ch.rounds_per_step):
            for info in round_chunks(ch, b, rnd):
                segs = info.segments
                assert segs[0][0] == 0 and segs[-1][1] == ch.chunk_tokens
                assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(segs, segs[1:]))
                for start, end, key in segs:
                    if info.split:  # rows are columns ctx.. of one sequence; keys its columns
                        row = rnd * ch.seqs_per_round + info.index // ch.chunks_per_seq
                        cols = np.arange(info.context + start, info.context + end)
                        keys = np.arange(key, info.context + end)
                        rows_of = np.full(cols.size, row)
                        key_rows = np.full(keys.size, row)
                    else:  # rows are short sequences one after another
                        g = np.arange(start, end)
                        rows_of = rnd * ch.seqs_per_round + info.index * ch.seqs_per_chunk \
                            + g // ch.seqlen
                        cols = g % ch.seqlen
                        kg = np.arange(key, end)
                        key_rows = rnd * ch.seqs_per_round + info.index * ch.seqs_per_chunk \
                            + kg // ch.seqlen
                        keys = kg % ch.seqlen
                    d = doc[rows_of, cols]
                    assert np.all(d == d[0]) and np.all(rows_of == rows_of[0])
                    assert np.all(key_rows == rows_of[0]) and np.all(doc[key_rows, keys] == d[0])
                    assert keys[0] == first[rows_of[0], cols[0]], "keys from the record's start"
    assert crossings >= 3 * ch.seqs_per_step, "the rows held many record boundaries"


def test_packed_position_resumes_bit_identically_across_an_epoch_boundary(bpe_dir, tmp_path,
                                                                        rng):
    """A fresh PackedCorpus given another's state() (through JSON) after any number k of
    batches yields the same next batches bit for bit, for positions inside a text document and
    just before and after an epoch ends; a state from another seed is refused."""
    corpus = _tokenise(_mixed_folder(tmp_path, rng), bpe_dir, tmp_path / "cache")
    seed = int(rng.integers(1 << 30))
    pc = PackedCorpus(corpus, 64, seed=seed)
    seen_offset = seen_epoch = False
    k = 0
    while pc.state()["epoch"] < 2:
        state = json.loads(json.dumps(pc.state()))
        seen_offset |= state["offset"] > 0
        seen_epoch |= state["epoch"] == 1
        fresh = PackedCorpus(corpus, 64, seed=seed)
        fresh.load_state(state)
        for _ in range(2):
            a, b = pc.next_batch(3), fresh.next_batch(3)
            for x, y in zip((a.tokens, a.labels, a.doc_ids), (b.tokens, b.labels, b.doc_ids)):
                assert np.array_equal(x, y)
        k += 2
    assert seen_offset and seen_epoch and k > 20
    with pytest.raises(ConfigError, match="same --data"):
        PackedCorpus(corpus, 64, seed=seed + 1).load_state(pc.state())


def test_held_out_records_are_the_corpus_tail_and_never_trained_on(bpe_dir, tmp_path, rng):
    """With eval_seqs, the last records in file order that hold eval_seqs rows are held out:
    two epochs of training rows never hold one of their tokens, and eval_batch holds only them,
    the same rows every call."""
    corpus = _tokenise(_mixed_folder(tmp_path, rng), bpe_dir, tmp_path / "cache")
    _, learn, starts, chat = _arrays(corpus)
    seqlen, eval_seqs = 64, 4
    lengths = np.diff(starts)
    held = total = 0
    while total < eval_seqs * (seqlen + 1):  # as few last records as hold the rows' tokens
        held += 1
        total += lengths[-held]
    first_held = int(starts[starts.size - 1 - held])
    pc = PackedCorpus(_tagged(corpus, tmp_path / "tagged"), seqlen, eval_seqs=eval_seqs,
                      seed=int(rng.integers(1 << 30)))
    silent = sum(int(lengths[r]) for r in range(starts.size - 1 - held)
                 if _silent(r, starts, learn, chat, seqlen + 1))
    assert pc.train_tokens == first_held - silent
    _, batches = _pack_epochs(pc, seqlen + 1, starts[:starts.size - held], learn, chat, 2)
    trained = np.concatenate([b.tokens.ravel() for b in batches])
    assert trained.max() <= first_held, "no held-out token in a training row"
    ev = pc.eval_batch(8)
    assert ev.tokens.shape == (eval_seqs, seqlen + 1)
    pos = ev.tokens[ev.tokens > 0].astype(np.int64) - 1
    assert pos.min() >= first_held
    again = pc.eval_batch(eval_seqs)
    assert np.array_equal(again.tokens, ev.tokens) and np.array_equal(again.labels, ev.labels)


# -- the cache --------------------------------------------------------------------------------
def _summary(corpus: Corpus) -> dict:
    s = dict(vars(corpus.summary))
    s.pop("seconds")
    return s


def _no_tokenising(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenised although the corpus was cached")

    monkeypatch.setattr(tokenise_mod, "_tokenise_unit", refuse)


def test_cache_is_reused_unchanged_and_any_change_of_data_template_or_tokenizer_retokenises(
        bpe_dir, tmp_path, rng, monkeypatch):
    """A second tokenise of unchanged data is cached (same key and path, nothing tokenised);
    one changed byte of a file, another chat template in tokenizer_config.json, or another
    tokenizer.json each give a new key and a corpus of the new ids; the old one stays cached;
    the cache holds only finished corpora."""
    words = corpus_words()
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    text = _text(rng, words, 20)
    (data / "doc.txt").write_text(text, encoding="utf-8")
    convs = [random_conversation(rng, words) for _ in range(8)]
    convs[0] = [m for m in convs[0] if m["role"] != "system"]  # the default system turn
    (data / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    lib = _lib(bpe_dir)

    def expected(lib, text, render=lambda c: render_chatml(c)[0]):
        chat_ids = sum((lib.encode(render(c), add_special_tokens=False).ids for c in convs), [])
        return np.asarray(chat_ids + lib.encode(text).ids + [lib.token_to_id(IM_END)])

    first = _tokenise(data, bpe_dir, cache)
    assert not first.cached and np.array_equal(_arrays(first)[0], expected(lib, text))
    with monkeypatch.context() as m:
        _no_tokenising(m)
        again = _tokenise(data, bpe_dir, cache)
    assert again.cached and again.path == first.path and again.key == first.key
    assert _summary(again) == _summary(first)

    at = next(i for i in rng.permutation(len(text)) if text[i].isascii() and text[i].isalpha())
    changed = text[:at] + ("x" if text[at] != "x" else "y") + text[at + 1:]
    (data / "doc.txt").write_text(changed, encoding="utf-8")
    one_byte = _tokenise(data, bpe_dir, cache)
    assert not one_byte.cached and one_byte.key != first.key and one_byte.path != first.path
    assert np.array_equal(_arrays(one_byte)[0], expected(lib, changed))
    (data / "doc.txt").write_text(text, encoding="utf-8")

    other_template = CHATML_TEMPLATE.replace(DEFAULT_SYSTEM, "Be brief.")
    assert other_template != CHATML_TEMPLATE
    templ_dir = tokenizer_copy(bpe_dir, tmp_path / "templ", other_template)
    templ = _tokenise(data, templ_dir, cache)
    assert not templ.cached and templ.key not in (first.key, one_byte.key)
    assert np.array_equal(_arrays(templ)[0],
                          expected(lib, text, lambda c: render_chatml(c, "Be brief.")[0]))

    other_dir = tmp_path / "bpe400"
    train_bpe(other_dir, vocab_size=400)
    write_tokenizer_config(other_dir)
    other = _tokenise(data, other_dir, cache)
    assert not other.cached and other.key not in (first.key, one_byte.key, templ.key)
    assert np.array_equal(_arrays(other)[0], expected(_lib(other_dir), text))

    with monkeypatch.context() as m:
        _no_tokenising(m)
        back = _tokenise(data, bpe_dir, cache)
    assert back.cached and back.path == first.path
    names = sorted(p.name for p in _entries(cache))
    assert len(names) == 4 and not any(n.startswith(".") for n in names)


class _CountingPool(concurrent.futures.ProcessPoolExecutor):
    """A ProcessPoolExecutor that counts the units submitted to its workers."""

    submitted = 0

    def submit(self, *args, **kwargs):
        type(self).submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("jobs", [1, 2])
def test_failure_half_way_leaves_no_corpus_and_no_temporary_folder(jobs, bpe_dir, tmp_path,
                                                                    rng, monkeypatch):
    """A bad record late in a JSONL of many units (UNIT_BYTES 256), in this process or in
    worker processes: the ConfigError names its line, several units had been written, and the
    cache directory is left empty; the fixed file then tokenises."""
    monkeypatch.setattr(tokenise_mod, "UNIT_BYTES", 256)
    if jobs > 1:
        monkeypatch.setattr(tokenise_mod, "PARALLEL_BYTES", 0)
        monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _CountingPool)
        _CountingPool.submitted = 0
    words = corpus_words()
    lines = [json.dumps({"text": random_sentence(rng, words, 5, 30)}) for _ in range(60)]
    good = list(lines)
    lines[57] = json.dumps({"txt": "misspelt field"})
    path, cache = tmp_path / "d.jsonl", tmp_path / "cache"
    path.write_text("\n".join(lines) + "\n")
    written = []
    add = tokenise_mod._Writer.add
    monkeypatch.setattr(tokenise_mod._Writer, "add",
                        lambda self, result: (written.append(1), add(self, result)))
    with pytest.raises(ConfigError, match=f"{path}:58: .*its fields: txt"):
        tokenise(path, load_tokenizer(bpe_dir), cache_dir=cache, jobs=jobs, progress=False)
    assert len(written) >= 3
    assert cache.is_dir() and _entries(cache) == []
    if jobs > 1:
        assert _CountingPool.submitted >= 4
    path.write_text("\n".join(good) + "\n")
    corpus = tokenise(path, load_tokenizer(bpe_dir), cache_dir=cache, jobs=jobs, progress=False)
    assert corpus.summary.records == 60 and [p.name for p in _entries(cache)] == [corpus.path.name]


def test_worker_processes_give_a_bit_identical_corpus(bpe_dir, tmp_path, rng, monkeypatch):
    """Tokenised by 2 worker processes (PARALLEL_BYTES 0, small units, a big text file's pieces
    falling in different units) or in this process: the same tokens, learn flags, starts, chat
    flags and summary, bit for bit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(tokenise_mod, "UNIT_BYTES", 1024)
    monkeypatch.setattr(tokenise_mod, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(records, "PIECE_CHARS", 2000)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _CountingPool)
    _CountingPool.submitted = 0
    words, data = corpus_words(), tmp_path / "data"
    data.mkdir()
    (data / "big.txt").write_text(_text(rng, words, 500), encoding="utf-8")
    write_chat_jsonl(data / "chat.jsonl", rng, 30)
    pq.write_table(pa.table({"text": [random_sentence(rng, words, 1, 30) for _ in range(20)]}),
                   data / "t.parquet")
    one = _tokenise(data, bpe_dir, tmp_path / "c1", jobs=1)
    assert _CountingPool.submitted == 0
    two = _tokenise(data, bpe_dir, tmp_path / "c2", jobs=2)
    assert _CountingPool.submitted >= 10
    assert one.key == two.key and _summary(one) == _summary(two)
    for x, y in zip(_arrays(one), _arrays(two)):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert _summary(one)["records"] == 1 + 30 + 20


# -- bad input: a ConfigError naming the file and the line or record ---------------------------
def _chat_line(messages) -> str:
    return json.dumps({"messages": messages})


def _ok_chat(rng, words) -> str:
    return _chat_line(random_conversation(rng, words))


def _bad_case(case, tmp_path, rng, bpe_dir):
    """(data path, tokenizer folder, tokenise kwargs, the words the refusal must hold)."""
    words = corpus_words()
    ok = [_ok_chat(rng, words) for _ in range(5)]
    path = tmp_path / "d.jsonl"
    if case == "missing field":
        lines = [json.dumps({"text": random_sentence(rng, words)}) for _ in range(5)]
        lines[3] = json.dumps({"body": "x", "id": 3, "lang": "en"})
        path.write_text("\n".join(lines) + "\n")
        return path, bpe_dir, {}, [f"{path}:4:", "neither a 'text' nor a 'messages' field",
                                   "its fields: body, id, lang", "--text-field"]
    if case == "not json":
        ok[2] = '{"messages": [{"role": "user", "content": "unclosed"}'
        path.write_text("\n".join(ok) + "\n")
        return path, bpe_dir, {}, [f"{path}:3:", "not a JSON object"]
    if case == "unknown role":
        ok[1] = _chat_line([{"role": "user", "content": "hi"},
                            {"role": "narrator", "content": "Meanwhile"}])
        path.write_text("\n".join(ok) + "\n")
        return path, bpe_dir, {}, [f"{path}:2:", "role 'narrator'", "does not know"]
    if case == "template raises":
        ok[4] = _chat_line([{"role": "user", "content": "hi"},
                            {"role": "tool", "content": "42"}])
        path.write_text("\n".join(ok) + "\n")
        return path, bpe_dir, {"chat_template": RAISING_TEMPLATE}, [
            f"{path}:5:", "the chat template refused it", "this template has no tool turns"]
    if case == "no template":
        path.write_text("\n".join(ok) + "\n")
        plain = tokenizer_copy(bpe_dir, tmp_path / "plain", template=None)
        return path, plain, {}, [f"{path}:1:", "no chat template", "--chat-template FILE"]
    if case == "parquet role":
        import pyarrow as pa
        import pyarrow.parquet as pq

        convs = [random_conversation(rng, words, turns=1) for _ in range(6)]
        for c in convs:  # one schema for every row: always a system turn
            if c[0]["role"] != "system":
                c.insert(0, {"role": "system", "content": "Hi."})
        convs[4][1]["role"] = "critic"
        path = tmp_path / "chat.parquet"
        pq.write_table(pa.table({"messages": convs}), path)
        return path, bpe_dir, {}, [f"{path}:row 4:", "role 'critic'"]
    assert case == "not utf-8"
    path = tmp_path / "d.txt"
    head = "Alice was beginning to get very tired\n".encode()
    path.write_bytes(head + b"of sitting \xff\xfe by her sister\n")
    return path, bpe_dir, {}, [f"{path}: byte {len(head) + 11:,} is not UTF-8", "UTF-8"]


@pytest.mark.parametrize("case", ["missing field", "not json", "unknown role", "template raises",
                                  "no template", "parquet role", "not utf-8"])
def test_bad_record_is_refused_naming_its_file_and_line(case, bpe_dir, tmp_path, rng):
    """A JSONL record without the field (listing the fields it has), a line that is not JSON, a
    role the template does not know (JSONL or Parquet), a template calling raise_exception, chat
    records with no chat template, text that is not UTF-8: each a ConfigError naming the file
    and the line, row or byte, and nothing cached."""
    path, tok_dir, kwargs, words = _bad_case(case, tmp_path, rng, bpe_dir)
    with pytest.raises(ConfigError) as info:
        _tokenise(path, tok_dir, tmp_path / "cache", **kwargs)
    message = str(info.value)
    for w in words:
        assert w in message, message
    assert _entries(tmp_path / "cache") == []


def test_tokenizer_with_more_ids_than_the_model_has_rows_is_refused(hf_llama_dir, bpe_dir):
    """choose_tokenizer: the model directory's own tokenizer (480 ids) fits its 512 rows, but a
    model of 300 rows is refused naming the tokenizer and both sizes; --tokenizer bytes fits."""
    tok = choose_tokenizer(hf_llama_dir, None, 512)
    assert tok.info.name == str(hf_llama_dir / "tokenizer.json")
    assert tok.info.vocab_size == 480 and tok.info.eos_id == _lib(bpe_dir).token_to_id(IM_END)
    with pytest.raises(ConfigError) as info:
        choose_tokenizer(hf_llama_dir, None, 300)
    message = str(info.value)
    assert str(hf_llama_dir / "tokenizer.json") in message
    assert "480 ids" in message and "vocab_size is 300" in message
    with pytest.raises(ConfigError, match="480 ids"):
        choose_tokenizer("tiny", str(bpe_dir), 256)
    assert choose_tokenizer(hf_llama_dir, "bytes", 300).is_bytes


# -- a run on a tokenised corpus resumes bit for bit -------------------------------------------
def _demo(capsys, model, data, tmp_path, *extra) -> dict:
    capsys.readouterr()
    code = demo_main(["0.5", "0.25", "64", str(model), "--backend", "numpy", "--json",
                      "--data", str(data), "--cache-dir", str(tmp_path / "cache"),
                      "--warmup", "2", "--seqs-per-step", "8", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _weights_digest(step_dir: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(step_dir.iterdir()) if p.name.endswith(".bin")}


def test_demo_on_chat_data_resumed_at_step_2_ends_with_the_same_weights(hf_llama_dir, tmp_path,
                                                                        rng, capsys):
    """dataflow-demo on the Llama directory and chat JSONL (its own tokenizer and template):
    4 steps straight, and 4 steps saving every 2 with step 4's checkpoint removed then resumed
    with --resume, have the same losses at steps 3-4 bit for bit and write the same weights and
    AdamW state; the checkpoint's data position is the corpus's, past its first epoch."""
    data = tmp_path / "chat.jsonl"
    write_chat_jsonl(data, rng, 12, hi=8)
    straight = _demo(capsys, hf_llama_dir, data, tmp_path, "--steps", "4", "--save-every", "4",
                     "--checkpoint-dir", str(tmp_path / "a"))
    ck = tmp_path / "b"
    _demo(capsys, hf_llama_dir, data, tmp_path, "--steps", "4", "--save-every", "2",
          "--checkpoint-dir", str(ck))
    saved = json.loads((ck / "step_00000002" / "checkpoint.json").read_text())["data"]
    assert saved["kind"] == "corpus" and saved["epoch"] >= 1  # 2 steps of 8 rows > 12 records
    shutil.rmtree(ck / "step_00000004")  # as if the run had stopped after step 2
    resumed = _demo(capsys, hf_llama_dir, data, tmp_path, "--steps", "4", "--save-every", "2",
                    "--checkpoint-dir", str(ck), "--resume")
    assert [s["step"] for s in resumed["steps"]] == [3, 4]
    pick = [(s["loss"], s["grad_norm"], s["loss_tokens"]) for s in straight["steps"][2:]]
    assert [(s["loss"], s["grad_norm"], s["loss_tokens"]) for s in resumed["steps"]] == pick
    assert _weights_digest(ck / "step_00000004") == _weights_digest(tmp_path / "a" /
                                                                    "step_00000004")
    losses = [s["loss"] for s in straight["steps"]]
    assert all(np.isfinite(losses)) and len(set(losses)) == 4


# -- dataflow-data --------------------------------------------------------------------------
def test_dataflow_data_prints_records_tokens_and_masked_share(hf_llama_dir, bpe_dir, tmp_path,
                                                              rng, capsys):
    """dataflow-data MODEL DATA exits 0 with a table whose records, tokens and masked share are
    those of the library's encoding of the ChatML rendering; run again it finds the corpus."""
    data = tmp_path / "chat.jsonl"
    convs = write_chat_jsonl(data, rng, 12)
    tokens, learn, _ = _expected_chat(_lib(bpe_dir), convs)
    capsys.readouterr()
    assert data_main([str(hf_llama_dir), str(data), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "tokenised:" in out and "records:          12 (12 chat)" in out
    assert f"tokens:           {tokens.size:,}" in out
    assert f"masked (no loss): {100 * (1 - learn.mean()):.1f} %" in out
    assert str(hf_llama_dir / "tokenizer.json") in out
    assert data_main([str(hf_llama_dir), str(data), "--cache-dir", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.startswith("corpus:")


def test_dataflow_data_json_reports_the_corpus(hf_llama_dir, bpe_dir, tmp_path, rng, capsys):
    """--json is one JSON document: records, chat records, tokens, learnt tokens, masked share,
    the longest record and where it is, and with --seqlen the records longer than a row."""
    data = tmp_path / "chat.jsonl"
    convs = write_chat_jsonl(data, rng, 12)
    tokens, learn, starts = _expected_chat(_lib(bpe_dir), convs)
    lengths = np.diff(starts)
    capsys.readouterr()
    assert data_main([str(hf_llama_dir), str(data), "--json", "--seqlen", "64",
                      "--cache-dir", str(tmp_path / "c"), "--too-long", "drop"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["records"] == doc["chat_records"] == 12
    assert doc["tokens"] == tokens.size and doc["learnt_tokens"] == int(learn.sum())
    assert doc["masked_share"] == pytest.approx(1 - learn.mean(), abs=1e-6)
    assert doc["longest_record"] == lengths.max()
    assert doc["longest_where"] == f"{data}:{int(np.argmax(lengths)) + 1}"
    assert doc["longer_than_row"] == doc["chat_longer_than_row"] == int((lengths > 65).sum())
    assert doc["too_long"] == "drop" and doc["cached"] is False
    assert doc["tokenizer"] == str(hf_llama_dir / "tokenizer.json")


def test_dataflow_data_exits_2_in_one_line_for_a_missing_field(hf_llama_dir, tmp_path, capsys):
    """A record without the text field: exit 2, one line naming the file, line and the field
    to pass, no traceback, nothing on stdout."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"content": "two"}) + "\n")
    capsys.readouterr()
    assert data_main([str(hf_llama_dir), str(data), "--cache-dir", str(tmp_path / "c")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{data}:2:" in err and "its fields: content" in err and "Traceback" not in err


def test_dataflow_data_exits_2_naming_a_tokenizer_json_the_library_cannot_read(
        hf_llama_dir, tmp_path, capsys):
    """The byte-level trap: a model directory whose tokenizer.json the library cannot read is
    refused (exit 2, one line naming that file), never tokenised as bytes."""
    model = tmp_path / "model"
    shutil.copytree(hf_llama_dir, model)
    (model / "tokenizer.json").write_text("{}")
    (tmp_path / "t.txt").write_text("Some text of the user's own.\n")
    capsys.readouterr()
    assert data_main([str(model), str(tmp_path / "t.txt")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert str(model / "tokenizer.json") in err and "tokenizers library can read" in err
    assert not (tmp_path / ".dataflow-cache").exists()


def _entries(cache):
    """What a cache folder holds besides the memo of data digests: corpora, or leftovers."""
    return sorted(p for p in cache.iterdir() if p.name != tokenise_mod.DIGEST_MEMO)


def test_a_template_dropping_earlier_reasoning_learns_each_visible_reply(bpe_dir):
    """A Qwen3-style template shows an earlier assistant turn without its <think> reasoning and
    the last one with it, so no rendering of a conversation's beginning is a prefix of the
    whole: each reply is found by its visible part, and exactly the replies (with their
    <|im_end|> and newline; the last with its think block) are learnt."""
    from dataflow.bench.chat_data import QWEN3
    from dataflow.data.chat import ChatTemplate

    tok = load_tokenizer(bpe_dir)
    tpl = ChatTemplate(QWEN3, tok.info.special_tokens, tok.added_tokens())
    messages = [{"role": "user", "content": "one plus one"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\ntwo"},
                {"role": "user", "content": "and two more"},
                {"role": "assistant", "content": "<think>\nadd two\n</think>\n\nfour"}]
    text, spans = tpl.render_with_spans(messages)
    assert "add them" not in text and "add two" in text
    learnt = [text[a:b] for a, b in spans]
    assert learnt == ["two<|im_end|>\n", "<think>\nadd two\n</think>\n\nfour<|im_end|>\n"]
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    text, spans = tpl.render_with_spans(short)  # 'd' is inside '<|im_end|>' too: not there
    assert [text[a:b] for a, b in spans] == ["b<|im_end|>\n", "d<|im_end|>\n"]


def test_chat_records_that_learn_nothing_in_a_row_are_left_out_and_counted(bpe_dir, tmp_path):
    """A record with no assistant turn, and one whose reply lies past the cut of a row, count no
    target: they are left out of the order (silent_records), so no batch counts nothing; the
    rest pack as before."""
    tok = load_tokenizer(bpe_dir)
    long_prompt = " ".join(["words"] * 200)
    rows = [{"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": long_prompt},
                          {"role": "assistant", "content": "late"}]}]
    rows += [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"a{i}"}]} for i in range(6)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = tokenise(path, tok, cache_dir=tmp_path / "cache", jobs=1, progress=False)
    packed = PackedCorpus(corpus, 63)
    assert packed.silent_records == 2 and packed.too_long_records == 1
    for _ in range(8):
        batch = packed.next_batch(2)
        assert (batch.labels[:, 1:] != -100).sum(axis=1).min() > 0


def _silent(r, starts, learn, chat, row) -> bool:
    """A chat record none of whose targets inside its row is learnt (PackedCorpus leaves it
    out), computed here from the flags one record at a time."""
    return bool(chat[r]) and not learn[starts[r] + 1:min(starts[r + 1], starts[r] + row)].any()


def test_the_vectorised_assistant_mask_is_transformers_loop(rng):
    """chat.assistant_token_mask (NumPy) equals transformers' token loop for assistant_masks on
    fresh random offsets (zero-width tokens, repeated starts, a trailing (0, 0) special token)
    and spans (none, touching, cutting a token)."""
    from dataflow.data.chat import assistant_token_mask

    def loop(offsets, spans):
        mask, s = [False] * len(offsets), 0
        for k, (a, b) in enumerate(offsets):
            while s < len(spans) and a >= spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if b > spans[s][0]:
                mask[k] = True
        return mask

    for _ in range(3000):
        pos, offsets = 0, []
        for _ in range(int(rng.integers(0, 30))):
            width = int(rng.integers(0, 5))
            offsets.append((pos, pos + width))
            pos += width if rng.random() < 0.9 else 0
        if offsets and rng.random() < 0.2:
            offsets.append((0, 0))
        k = 2 * min((pos + 3) // 2, int(rng.integers(0, 4)))
        cuts = sorted(rng.choice(pos + 3, k, replace=False).tolist())
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, k, 2)]
        assert assistant_token_mask(offsets, spans).tolist() == loop(offsets, spans)


def test_a_held_out_tail_that_learns_nothing_is_refused_and_silent_ones_are_skipped(
        bpe_dir, tmp_path):
    """Validation never runs on rows with no target: held-out chat records with nothing learnt
    in a row are left out of eval_batch, and a tail made only of them is refused by name."""
    tok = load_tokenizer(bpe_dir)
    learn = [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"answer {i}"}]} for i in range(30)]
    mute = [{"messages": [{"role": "user", "content": " ".join(["words"] * 30)}]}] * 8
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in learn + mute + learn[:3]))
    corpus = tokenise(path, tok, cache_dir=tmp_path / "cache", jobs=1, progress=False)
    ev = PackedCorpus(corpus, 63, eval_seqs=2).eval_batch(2)
    assert all((row[1:] != -100).any() for row in ev.labels)
    path.write_text("".join(json.dumps(r) + "\n" for r in learn + mute))
    corpus = tokenise(path, tok, cache_dir=tmp_path / "cache", jobs=1, progress=False)
    with pytest.raises(ConfigError, match="held-out records at its end learn nothing"):
        PackedCorpus(corpus, 63, eval_seqs=2)
