"""Token sources: the shipped byte-level corpus and the resumable Parquet packer."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataflow.data import (
    ArrowTokenDataset,
    decode,
    encode,
    shipped_text,
    shipped_tokens,
    token_stream,
)
from dataflow.models import ConfigError

V = 512
EOS = V - 1


def _write(path, docs, row_group_size=7, column="tokens"):
    table = pa.table(
        {
            column: pa.array(docs, type=pa.list_(pa.int32())),
            "id": pa.array(range(len(docs)), type=pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _random_docs(rng, n, max_len=40):
    docs = [rng.integers(0, V - 1, rng.integers(1, max_len)).tolist() for _ in range(n)]
    docs[3] = []  # an empty document contributes only its eos
    return docs


def _rows(stream: np.ndarray, start: int, n_seqs: int, seqlen: int) -> np.ndarray:
    return np.stack(
        [stream[start + i * seqlen : start + i * seqlen + seqlen + 1] for i in range(n_seqs)]
    )


def test_shipped_text_is_long_and_round_trips_through_byte_tokens():
    """The corpus is >= 100 KB, its tokens are bytes, and decoding them gives the text back."""
    text, tokens = shipped_text(), shipped_tokens()
    assert tokens.dtype == np.int32 and tokens.size >= 100_000
    assert tokens.min() >= 0 and tokens.max() < 256
    assert decode(tokens) == text
    assert np.array_equal(encode(text), tokens)
    assert "Alice" in text and "gutenberg" not in text.lower()


def test_token_stream_rows_are_shifted_windows_that_wrap_around():
    """Rows overlap by one token, continue across calls via start, and wrap past the end."""
    tokens = shipped_tokens()
    seqlen, n = 4096, 50  # 204,800 tokens: more than the corpus, so it wraps
    rows = token_stream(seqlen, n, V)
    assert rows.shape == (n, seqlen + 1) and rows.dtype == np.int32
    assert np.array_equal(rows[:-1, -1], rows[1:, 0])
    ref = np.concatenate([tokens, tokens])
    assert np.array_equal(rows.reshape(-1)[: seqlen + 1], tokens[: seqlen + 1])
    assert np.array_equal(rows[-1], ref[(n - 1) * seqlen % tokens.size :][: seqlen + 1])
    nxt = token_stream(seqlen, 2, V, start=n * seqlen)
    assert nxt[0, 0] == rows[-1, -1]


def test_token_stream_refuses_vocab_below_256_and_names_the_minimum():
    """A vocabulary that cannot hold byte ids is refused with the minimum in the message."""
    with pytest.raises(ConfigError, match="vocab_size 200 is below 256"):
        token_stream(16, 2, 200)
    with pytest.raises(ConfigError, match="seqlen"):
        token_stream(0, 2, V)


def test_arrow_loader_packs_documents_in_file_order(tmp_path):
    """Without shuffle, rows are windows of the docs+eos stream, repeated over epochs."""
    rng = np.random.default_rng(0)
    docs_a, docs_b = _random_docs(rng, 20), _random_docs(rng, 13)
    files = [_write(tmp_path / "a.parquet", docs_a), _write(tmp_path / "b.parquet", docs_b, 5)]
    epoch = np.array([t for d in docs_a + docs_b for t in d + [EOS]], np.int32)
    stream = np.tile(epoch, 10)
    seqlen = 16
    ds = ArrowTokenDataset(files, seqlen, vocab_size=V, eos_id=EOS)
    pos = 0
    for n in (1, 3, 7, 2, 30):  # 30 rows cross the epoch boundary
        assert np.array_equal(ds.next_batch(n), _rows(stream, pos, n, seqlen))
        pos += n * seqlen
    assert ds.state()["epoch"] == pos // epoch.size


def test_arrow_loader_without_eos_concatenates_documents(tmp_path):
    """With eos_id=None documents are joined directly and empty ones vanish."""
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, 9)
    path = _write(tmp_path / "d.parquet", docs, 4)
    stream = np.tile(np.array([t for d in docs for t in d], np.int32), 20)
    ds = ArrowTokenDataset(path, 8, vocab_size=V)
    got = np.concatenate([ds.next_batch(5) for _ in range(4)])
    assert np.array_equal(got, _rows(stream, 0, 20, 8))


def test_arrow_loader_shuffles_each_epoch_deterministically(tmp_path):
    """Shuffled epochs are permutations of the documents, differ across epochs and seeds, and
    repeat for the same seed."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, V - 1, rng.integers(1, 30)).tolist() for _ in range(25)]
    path = _write(tmp_path / "s.parquet", docs, 6)
    n_tokens = sum(len(d) + 1 for d in docs)

    def epochs(seed, n_epochs=2):
        ds = ArrowTokenDataset(path, n_tokens, vocab_size=V, eos_id=EOS, shuffle=True, seed=seed)
        flat = np.concatenate([ds.next_batch(1)[0, :-1] for _ in range(n_epochs)])
        out = []
        for e in range(n_epochs):
            part = flat[e * n_tokens : (e + 1) * n_tokens].tolist()
            found, cur = [], []
            for t in part:
                if t == EOS:
                    found.append(cur)
                    cur = []
                else:
                    cur.append(t)
            out.append(found)
        return out

    e0, e1 = epochs(seed=5)
    key = sorted(map(tuple, docs))
    assert sorted(map(tuple, e0)) == key and sorted(map(tuple, e1)) == key
    assert e0 != docs and e0 != e1
    assert epochs(seed=5) == [e0, e1]
    assert epochs(seed=6)[0] != e0


@pytest.mark.parametrize("shuffle", [False, True])
def test_restored_loader_produces_the_same_next_batches(tmp_path, shuffle):
    """After k batches, a fresh loader given state() yields exactly the next m batches."""
    rng = np.random.default_rng(3)
    files = [_write(tmp_path / f"{i}.parquet", _random_docs(rng, 15, 16), 4) for i in range(3)]

    def make():
        return ArrowTokenDataset(files, 12, vocab_size=V, eos_id=EOS, shuffle=shuffle, seed=9)

    ds = make()
    for _ in range(5):
        ds.next_batch(4)
    state = json.loads(json.dumps(ds.state()))
    want = [ds.next_batch(n) for n in (3, 8, 1, 16, 9)]  # crosses epochs
    assert ds.state()["epoch"] >= 1
    again = make()
    again.load_state(state)
    got = [again.next_batch(n) for n in (3, 8, 1, 16, 9)]
    for w, g in zip(want, got):
        assert np.array_equal(w, g)


def test_state_from_another_dataset_is_refused(tmp_path):
    """A state saved with another seed or file set cannot be loaded."""
    rng = np.random.default_rng(4)
    path = _write(tmp_path / "x.parquet", _random_docs(rng, 10))
    a = ArrowTokenDataset(path, 8, vocab_size=V, eos_id=EOS, shuffle=True, seed=1)
    b = ArrowTokenDataset(path, 8, vocab_size=V, eos_id=EOS, shuffle=True, seed=2)
    with pytest.raises(ConfigError, match="build the loader exactly"):
        b.load_state(a.state())
    with pytest.raises(ConfigError, match="expected"):
        b.load_state({"epoch": 0})


def test_out_of_vocab_token_id_is_refused_with_its_location(tmp_path):
    """A token id >= vocab_size is refused naming the id, the file, the row and position."""
    rng = np.random.default_rng(5)
    docs = _random_docs(rng, 12)
    docs[9] = [1, 2, 3, 700, 4]
    path = _write(tmp_path / "bad.parquet", docs, 5)
    ds = ArrowTokenDataset(path, 8, vocab_size=V, eos_id=EOS)
    with pytest.raises(ConfigError, match=r"token id 700 in .*bad\.parquet.*row 9 .*position 3"):
        ds.check_all()
    ds = ArrowTokenDataset(path, 8, vocab_size=V, eos_id=EOS)
    with pytest.raises(ConfigError, match="vocab_size 512"):
        for _ in range(20):
            ds.next_batch(2)


def test_missing_column_and_bad_arguments_are_refused(tmp_path):
    """Unknown columns, missing files and an eos outside the vocabulary are named."""
    path = _write(tmp_path / "c.parquet", [[1, 2], [3]], column="ids")
    with pytest.raises(ConfigError, match="no column 'tokens'.*'ids'"):
        ArrowTokenDataset(path, 4, vocab_size=V)
    with pytest.raises(ConfigError, match="does not exist"):
        ArrowTokenDataset(tmp_path / "nope.parquet", 4, vocab_size=V, column="ids")
    with pytest.raises(ConfigError, match="eos_id 600"):
        ArrowTokenDataset(path, 4, vocab_size=V, column="ids", eos_id=600)
    ds = ArrowTokenDataset(tmp_path, 4, vocab_size=V, column="ids")  # a directory works too
    assert np.array_equal(ds.next_batch(1), [[1, 2, 3, 1, 2]])
