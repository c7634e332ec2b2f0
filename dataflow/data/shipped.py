"""A token source that needs no network: a public-domain English text shipped inside the package
(corpus.txt, Lewis Carroll's "Alice's Adventures in Wonderland"; see CORPUS_SOURCE.md),
tokenised byte-level, so token id = UTF-8 byte value (0..255). Never downloads anything and
never maps ids into a smaller vocabulary: a model needs vocab_size >= 256 to read it."""

from __future__ import annotations

import functools
from importlib import resources

from pathlib import Path

import numpy as np

from dataflow.models.errors import ConfigError

BYTE_VOCAB = 256
"""Byte-level tokenisation uses ids 0..255, so a model needs at least this many rows."""


@functools.lru_cache(maxsize=1)
def _corpus_bytes() -> bytes:
    return resources.files("dataflow.data").joinpath("corpus.txt").read_bytes()


def shipped_text_path() -> Path:
    """The shipped text's file (tokenised like any --data when a model has its own tokenizer)."""
    return Path(str(resources.files("dataflow.data").joinpath("corpus.txt")))


def shipped_text() -> str:
    """The shipped corpus as text."""
    return _corpus_bytes().decode("utf-8")


def shipped_tokens() -> np.ndarray:
    """The corpus as token ids: (N,) int32, one per UTF-8 byte. A fresh, writable copy."""
    return np.frombuffer(_corpus_bytes(), dtype=np.uint8).astype(np.int32)


def encode(text: str) -> np.ndarray:
    """Byte-level tokens of `text`: (N,) int32 UTF-8 byte values."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Text of byte-level tokens; ids outside 0..255 are refused, invalid UTF-8 is replaced."""
    ids = np.asarray(tokens).reshape(-1)
    bad = np.flatnonzero((ids < 0) | (ids >= BYTE_VOCAB))
    if bad.size:
        raise ConfigError(
            f"token id {int(ids[bad[0]])} at position {int(bad[0])} is not a "
            f"byte (0..{BYTE_VOCAB - 1}); decode only byte-level tokens"
        )
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def token_stream(seqlen: int, n_seqs: int, vocab_size: int, *, start: int = 0) -> np.ndarray:
    """Training rows from the shipped text, repeated end to end to fill any length.

    Returns (n_seqs, seqlen + 1) int32: row i is the seqlen + 1 tokens starting at stream
    position start + i * seqlen, so inputs are row[:-1] and next-token targets row[1:], and
    consecutive rows overlap by one token (every token is a target once, as in llm.c's loader).
    The next call's `start` is start + n_seqs * seqlen. `vocab_size` must be >= 256.
    """
    for name, value in (("seqlen", seqlen), ("n_seqs", n_seqs)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"vocab_size {vocab_size} is below {BYTE_VOCAB}, the minimum for the "
            "shipped byte-level corpus (ids are UTF-8 bytes 0..255); use a model "
            f"with vocab_size >= {BYTE_VOCAB} (tiny has 512)"
        )
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ConfigError(f"start must be a non-negative integer, got {start!r}")
    tokens = np.frombuffer(_corpus_bytes(), dtype=np.uint8)
    pos = start + np.arange(n_seqs, dtype=np.int64)[:, None] * seqlen
    idx = (pos + np.arange(seqlen + 1, dtype=np.int64)[None, :]) % tokens.size
    return tokens[idx].astype(np.int32)
