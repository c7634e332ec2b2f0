"""User data for a run: token files of every supported kind read memory-mapped in the documented
order, resumable from a saved position, a held-out tail never trained on, and a validation loss
that matches the engine's own loss."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.data.sources import LLMC_MAGIC, ArraySource, open_source
from dataflow.models.errors import ConfigError


def _write(kind: str, tokens: np.ndarray, tmp_path):
    if kind == "npy":
        path = tmp_path / "t.npy"
        np.save(path, tokens.astype(np.uint32))
    elif kind == "bin16":
        path = tmp_path / "t.bin"
        tokens.astype(np.uint16).tofile(path)
    elif kind == "bin32":
        path = tmp_path / "t.u32.bin"
        tokens.astype(np.uint32).tofile(path)
    elif kind == "llmc":
        path = tmp_path / "t_llmc.bin"
        header = np.zeros(256, np.int32)
        header[:3] = LLMC_MAGIC, 2, tokens.size
        with open(path, "wb") as f:
            f.write(header.tobytes() + tokens.astype(np.uint32).tobytes())
    else:
        path = tmp_path / "t.txt"
        path.write_bytes(tokens.astype(np.uint8).tobytes())
    return path


@pytest.mark.parametrize("kind", ["npy", "bin16", "bin32", "llmc", "text"])
def test_token_files_read_in_order_and_resume_from_a_saved_position(kind, tmp_path, rng):
    """Rows are consecutive windows of the file (overlapping by one token), wrap at the end of
    the training part, and a second source loaded with the first's state continues it."""
    vocab = 256 if kind == "text" else 1000
    tokens = rng.integers(0, vocab, 997)
    src = open_source(_write(kind, tokens, tmp_path), 16, vocab)
    assert isinstance(src._train, np.memmap) or kind == "npy"
    first = src.next_batch(3)
    assert first.dtype == np.int32 and first.shape == (3, 17)
    assert np.array_equal(first.reshape(-1)[:17], tokens[:17])
    assert np.array_equal(first[1], tokens[16:33])
    for _ in range(20):  # past the end: wraps around
        src.next_batch(3)
    state = src.state()
    again = open_source(_write(kind, tokens, tmp_path), 16, vocab)
    again.load_state(state)
    want = src.next_batch(3)
    assert np.array_equal(again.next_batch(3), want)
    pos = (21 * 48) % 997
    assert np.array_equal(want[0], np.take(tokens, np.arange(pos, pos + 17), mode="wrap"))


def test_shipped_source_equals_token_stream():
    """Without --data the demo's stream is exactly the one it always trained on."""
    src = open_source(None, 64, 512)
    for start in (0, 4 * 64, 8 * 64):
        assert np.array_equal(src.next_batch(4), token_stream(64, 4, 512, start=start))


def test_held_out_tail_is_never_trained_on(rng):
    """With held-out sequences, training batches come only from the head of the file and the
    eval batch is the tail, the same every call."""
    tokens = np.concatenate([rng.integers(0, 100, 500), rng.integers(100, 200, 3 * 32 + 1)])
    src = ArraySource(tokens, 32, 200, name="mem", eval_seqs=3)
    assert src.train_tokens == 500
    for _ in range(50):
        assert src.next_batch(4).max() < 100
    held = src.eval_batch(8)
    assert held.shape == (3, 33) and held.min() >= 100
    assert np.array_equal(held, src.eval_batch(3))


def test_resume_with_another_split_or_file_is_refused(tmp_path, rng):
    """A position saved with a held-out split does not load into a source without one."""
    path = _write("npy", rng.integers(0, 50, 400), tmp_path)
    state = open_source(path, 8, 50, eval_seqs=2).state()
    with pytest.raises(ConfigError, match="same --data"):
        open_source(path, 8, 50).load_state(state)


def test_out_of_vocabulary_ids_are_refused_naming_the_file(tmp_path, rng):
    """A token id the model cannot embed is refused when the file is opened, with the file's
    name, the id and its position."""
    tokens = rng.integers(0, 50, 300)
    tokens[5] = 777
    path = _write("bin16", tokens, tmp_path)
    with pytest.raises(ConfigError, match=r"t\.bin: token id 777 at position 5 "):
        open_source(path, 8, 100)


def test_parquet_source_holds_out_the_last_file(tmp_path, rng):
    """Parquet data trains on all files but the last when held-out data is asked for."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, (lo, hi) in enumerate([(0, 50), (50, 100)]):
        docs = [rng.integers(lo, hi, int(rng.integers(5, 40))).tolist() for _ in range(30)]
        pq.write_table(pa.table({"tokens": docs}), tmp_path / f"part{i}.parquet")
    src = open_source(tmp_path, 16, 100, eval_seqs=2)
    assert all(src.next_batch(4).max() < 50 for _ in range(5))
    assert src.eval_batch(2).min() >= 50
    state = src.state()
    again = open_source(tmp_path, 16, 100, eval_seqs=2)
    again.load_state(state)
    assert np.array_equal(again.next_batch(4), src.next_batch(4))
    with pytest.raises(ConfigError, match="two files"):
        open_source(tmp_path / "part0.parquet", 16, 100, eval_seqs=2)


def test_eval_loss_matches_the_engines_loss_and_changes_nothing():
    """The host forward's loss on a batch equals (to bf16 tolerance) the engine's forward-only
    eval_step and the loss train_step reports for it, and evaluating leaves weights and step
    untouched."""
    from dataflow.engine import Engine
    from dataflow.host_forward import eval_loss

    with Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", lr=1e-3) as eng:
        batch = token_stream(64, eng.seqs_per_step, 512, start=123)
        ref = eng.block_refs()[1]
        before = eng.read_block(ref).copy()
        loss = eval_loss(eng, batch)
        assert eng.eval_step(batch) == pytest.approx(loss, rel=2e-3)  # the demo's --eval-every
        assert eng.optimizer.step_count == 0
        assert np.array_equal(eng.read_block(ref).view(np.uint16), before.view(np.uint16))
        assert eng.train_step(batch).loss == pytest.approx(loss, rel=2e-3)


def test_shipped_corpus_repeats_to_fill_a_longer_sequence_and_user_data_is_refused(tmp_path):
    """The shipped corpus at a seqlen beyond its length repeats itself (benchmarks of long
    context); a user's file that short is still refused, naming both numbers."""
    src = open_source(None, 400_000, 256)
    n = src.train_tokens
    row = src.next_batch(1)[0]
    assert row.size == 400_001 and n < 400_000
    assert np.array_equal(row[n:2 * n], row[:n])
    short = tmp_path / "t.npy"
    np.save(short, np.arange(100, dtype=np.uint16))
    with pytest.raises(ConfigError, match="holds 100 tokens.*seqlen \\+ 1 = 129"):
        open_source(short, 128, 256)
