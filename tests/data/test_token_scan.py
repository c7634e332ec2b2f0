"""Issue 51 D: a token file is scanned once when it is opened, so an id outside the vocabulary
is refused naming the file, its position, its value and the vocabulary size before any model
is built (the demo exits 2 at once), not when its batch comes up steps later."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.cli import demo
from dataflow.data import sources
from dataflow.data.sources import check_token_ids, open_source
from dataflow.models.errors import ConfigError


def _tokens(rng, n: int, dtype) -> np.ndarray:
    return rng.integers(0, 500, n).astype(dtype)


def _write(kind: str, tokens: np.ndarray, tmp_path):
    path = tmp_path / f"tokens.{kind}"
    if kind == "npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    return path


@pytest.mark.parametrize("kind,dtype,bad", [("npy", np.int32, -7), ("npy", np.int64, 512),
                                            ("bin", np.uint16, 40_000)])
def test_open_source_names_the_first_out_of_vocab_id_and_its_position(tmp_path, rng, kind,
                                                                       dtype, bad,
                                                                       monkeypatch):
    """The id sits in the third scan piece (pieces shrunk to 1,000 tokens): the error names
    the file, position, value and vocab_size."""
    monkeypatch.setattr(sources, "SCAN_PIECE_TOKENS", 1_000)
    tokens = _tokens(rng, 5_000, dtype)
    tokens[2_345] = bad
    tokens[4_000] = bad  # a later one is not the one named
    path = _write(kind, tokens, tmp_path)
    with pytest.raises(ConfigError) as info:
        open_source(path, 16, 512)
    text = str(info.value)
    assert str(path) in text and f"token id {bad} at position 2,345" in text
    assert "[0, 512)" in text


def test_a_clean_file_opens_and_reads_the_same_tokens(tmp_path, rng, monkeypatch):
    """The scan changes nothing of what the source yields (pieces smaller than the file)."""
    monkeypatch.setattr(sources, "SCAN_PIECE_TOKENS", 777)
    tokens = _tokens(rng, 5_000, np.uint16)
    src = open_source(_write("bin", tokens, tmp_path), 16, 512)
    assert np.array_equal(src.next_batch(2)[0], tokens[:17].astype(np.int32))


def test_in_memory_arrays_are_scanned_too(rng):
    tokens = _tokens(rng, 100, np.int32)
    tokens[99] = 600
    with pytest.raises(ConfigError, match="token id 600 at position 99"):
        check_token_ids(tokens, 512, "mem")
    check_token_ids(tokens, 601, "mem")


@pytest.mark.parametrize("kind", ["npy", "bin"])
def test_demo_refuses_an_out_of_vocab_file_before_building_the_engine(tmp_path, rng, capsys,
                                                                      monkeypatch, kind):
    """dataflow-demo --data with a bad id exits 2 with one line naming it; no plan is made and
    no Engine is built."""
    tokens = _tokens(rng, 20_000, np.uint16 if kind == "bin" else np.int32)
    tokens[12_345] = 9_999
    path = _write(kind, tokens, tmp_path)

    def no_plan(*args, **kwargs):
        raise AssertionError("planned before the data was checked")

    monkeypatch.setattr(demo, "make_plan", no_plan)
    capsys.readouterr()
    code = demo.main(["0.5", "0.25", "64", "tiny", "--backend", "numpy", "--steps", "2",
                      "--data", str(path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dataflow-demo:")]
    assert code == 2 and len(lines) == 1, err
    assert str(path) in lines[0] and "token id 9999 at position 12,345" in lines[0]
    assert "[0, 512)" in lines[0]
