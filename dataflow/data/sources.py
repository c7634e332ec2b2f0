"""Token sources for a training run, opened from a path: a text file (byte-level tokens, as the
shipped corpus), a token file (.npy, or raw uint16/uint32 .bin as nanoGPT and llm.c write them)
or Parquet (a file or a directory, through ArrowTokenDataset). Token files are memory-mapped,
never read whole; a token file is scanned once when opened (in pieces) for ids outside the
vocabulary. Each source has a documented order, a JSON-able resumable position and an
optional held-out slice for validation. Never tokenises, never downloads, never touches a model.

Order of a token-array source: the training part is one stream read front to back and wrapped
around at its end; batch rows start seqlen apart and hold seqlen + 1 tokens (rows overlap by one
token, as dataflow.data.token_stream). The held-out slice is the LAST eval tokens of the file
(held-out sequences x seqlen + 1) and is never trained on; it exists only when asked for, so
asking for it changes which tokens train (the position records the split and refuses a mismatch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np

from dataflow.data.shipped import BYTE_VOCAB, _corpus_bytes
from dataflow.models.errors import ConfigError

log = logging.getLogger(__name__)

LLMC_MAGIC = 20240520
"""llm.c's .bin header: 256 int32 (magic, version, token count, ...) then the tokens; version 1
holds uint16 tokens (GPT-2), version 2 uint32 (Llama 3)."""
_LLMC_HEADER_BYTES = 256 * 4
TEXT_SUFFIXES = (".txt", ".md", ".text")


class ArraySource:
    """A 1-D token array (memory-mapped) split into a training stream and a held-out tail."""

    def __init__(self, tokens: np.ndarray, seqlen: int, vocab_size: int, *, name: str,
                 eval_seqs: int = 0, repeat_short: bool = False):
        """repeat_short: a training part shorter than one sequence is repeated to fill it (the
        shipped corpus at long seqlen, for benchmarks) instead of refused."""
        _check_positive("seqlen", seqlen)
        self.seqlen, self.vocab_size, self.name = seqlen, vocab_size, name
        held = eval_seqs * seqlen + 1 if eval_seqs else 0
        short = tokens.size - held < seqlen + 1
        if short and repeat_short and tokens.size - held > 0:
            log.warning("%s holds %d training tokens, fewer than seqlen + 1 = %d: each sequence "
                        "repeats it (fine for measuring speed and memory, not for learning)",
                        name, tokens.size - held, seqlen + 1)
        elif short:
            raise ConfigError(f"{name} holds {tokens.size} tokens; training needs at least "
                              f"seqlen + 1 = {seqlen + 1} after the {held} held out for "
                              "validation; use more data, a shorter seqlen or fewer eval "
                              "sequences")
        self._train = tokens[: tokens.size - held]
        self._held = tokens[tokens.size - held:]
        self.eval_seqs = eval_seqs
        ident = [name, int(tokens.size), str(tokens.dtype), held]
        self._fingerprint = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
        self._pos = 0

    @property
    def train_tokens(self) -> int:
        return int(self._train.size)

    def next_batch(self, n_seqs: int) -> np.ndarray:
        """The next (n_seqs, seqlen + 1) int32 rows; advances by n_seqs * seqlen tokens."""
        _check_positive("n_seqs", n_seqs)
        n = self._train.size
        pos = self._pos + np.arange(n_seqs, dtype=np.int64)[:, None] * self.seqlen
        idx = (pos + np.arange(self.seqlen + 1, dtype=np.int64)[None, :]) % n
        rows = self._rows(self._train, idx, "training")
        self._pos = (self._pos + n_seqs * self.seqlen) % n
        return rows

    def eval_batch(self, n_seqs: int) -> np.ndarray | None:
        """The held-out rows, the same every call (None when nothing is held out)."""
        if not self.eval_seqs:
            return None
        n_seqs = min(n_seqs, self.eval_seqs)
        idx = (np.arange(n_seqs, dtype=np.int64)[:, None] * self.seqlen
               + np.arange(self.seqlen + 1, dtype=np.int64)[None, :])
        return self._rows(self._held, idx, "held-out")

    def _rows(self, tokens, idx, part: str) -> np.ndarray:
        rows = np.asarray(tokens[idx.reshape(-1)]).reshape(idx.shape)
        bad = np.flatnonzero(rows.reshape(-1) >= self.vocab_size)
        if bad.size:
            raise ConfigError(f"token id {int(rows.reshape(-1)[bad[0]])} in {self.name} "
                              f"({part} part) is outside the model's vocabulary [0, "
                              f"{self.vocab_size}); use a model whose vocab_size covers the "
                              "tokenizer")
        return rows.astype(np.int32)

    def state(self) -> dict:
        return {"kind": "tokens", "dataset": self._fingerprint, "position": int(self._pos)}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "tokens":
            raise ConfigError(f"data position {state!r} is not for a token file; resume with "
                              "the --data the checkpoint was trained on")
        if state.get("dataset") != self._fingerprint:
            raise ConfigError(f"data position is for dataset {state.get('dataset')!r}, but "
                              f"{self.name} with this held-out split is {self._fingerprint!r}; "
                              "resume with the same --data, --eval-every and --eval-seqs as the "
                              "saved run")
        pos = state.get("position")
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < self._train.size:
            raise ConfigError(f"data position {pos!r} is outside [0, {self._train.size})")
        self._pos = pos


class ParquetSource:
    """Parquet through ArrowTokenDataset; with held-out sequences the last file is held out."""

    def __init__(self, files: list[Path], seqlen: int, vocab_size: int, *, eval_seqs: int = 0):
        # pyarrow adds about 0.2 s to the import: loaded only when Parquet data is used
        from dataflow.data.arrow import ArrowTokenDataset

        self.seqlen, self.name, self.eval_seqs = seqlen, str(files[0].parent), eval_seqs
        if eval_seqs and len(files) < 2:
            raise ConfigError(f"held-out data from Parquet needs at least two files (the last "
                              f"is held out), got {[str(f) for f in files]}; split the data "
                              "into several files or drop --eval-every")
        train = files[:-1] if eval_seqs else files
        self._ds = ArrowTokenDataset(train, seqlen, vocab_size=vocab_size)
        self._held = ArrowTokenDataset(files[-1:], seqlen, vocab_size=vocab_size) \
            if eval_seqs else None

    def next_batch(self, n_seqs: int) -> np.ndarray:
        return self._ds.next_batch(n_seqs)

    def eval_batch(self, n_seqs: int) -> np.ndarray | None:
        if self._held is None:
            return None
        self._held.load_state({**self._held.state(), "epoch": 0, "document": 0, "offset": 0})
        return self._held.next_batch(min(n_seqs, self.eval_seqs))

    def state(self) -> dict:
        return {"kind": "parquet", **self._ds.state()}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "parquet":
            raise ConfigError(f"data position {state!r} is not for Parquet data; resume with "
                              "the --data the checkpoint was trained on")
        self._ds.load_state({k: v for k, v in state.items() if k != "kind"})


def open_source(path: str | Path | None, seqlen: int, vocab_size: int, *, eval_seqs: int = 0):
    """A token source for `path` (None: the shipped corpus). Text (.txt/.md/.text) is byte-level
    tokens; .npy a 1-D integer array; .bin an llm.c file (header picks uint16/uint32) or raw
    uint16 (nanoGPT), or raw uint32 when the name ends in .u32.bin; .parquet or a directory of
    them goes through ArrowTokenDataset (column 'tokens')."""
    if path is None:
        _check_bytes_vocab(vocab_size, "the shipped corpus")
        tokens = np.frombuffer(_corpus_bytes(), dtype=np.uint8)
        return ArraySource(tokens, seqlen, vocab_size, name="shipped corpus", eval_seqs=eval_seqs,
                           repeat_short=True)
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"--data {path}: no Parquet files there; pass a .parquet file or "
                              "a directory of them")
        return ParquetSource(files, seqlen, vocab_size, eval_seqs=eval_seqs)
    check_regular_file(path)
    if path.suffix == ".npy":
        tokens = _npy_tokens(path)
    elif path.suffix == ".bin":
        tokens = _bin_tokens(path)
    elif path.suffix in TEXT_SUFFIXES:
        _check_bytes_vocab(vocab_size, str(path))
        tokens = np.memmap(path, np.uint8, mode="r")
    else:
        raise ConfigError(f"--data {path}: unknown kind of file '{path.suffix}'; use text "
                          f"({', '.join(TEXT_SUFFIXES)}), .npy, .bin or .parquet")
    check_token_ids(tokens, vocab_size, str(path))
    return ArraySource(tokens, seqlen, vocab_size, name=str(path), eval_seqs=eval_seqs)


SCAN_PIECE_TOKENS = 1 << 22
"""Tokens read per piece when a token file is scanned (8-16 MiB): the scan's whole footprint."""


def check_token_ids(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    """Refuse (ConfigError naming `name`, the first offending position and id, and vocab_size)
    a token array holding an id outside [0, vocab_size). One pass, vectorised per piece of
    SCAN_PIECE_TOKENS; a memory map is read through a reused buffer, not its mapping, so the
    scan adds one piece to the process's memory however large the file (pages read through a
    mapping would stay resident in it). Skipped when the dtype cannot hold a bad id."""
    if tokens.size == 0 or _dtype_fits(tokens.dtype, vocab_size):
        return
    t0 = time.perf_counter()
    for start, piece in _pieces(tokens):
        bad = (piece >= vocab_size) if piece.dtype.kind == "u" else \
            ((piece < 0) | (piece >= vocab_size))
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise ConfigError(f"--data {name}: token id {int(piece[at])} at position "
                              f"{start + at:,} is outside the model's vocabulary [0, "
                              f"{vocab_size}); use a model whose vocab_size covers the "
                              "tokenizer, or fix the file")
    seconds = time.perf_counter() - t0
    if seconds > 1.0:
        log.info("scanned %s: %d token ids, all below %d (%.1f s)", name, tokens.size,
                 vocab_size, seconds)


def _dtype_fits(dtype: np.dtype, vocab_size: int) -> bool:
    info = np.iinfo(dtype)
    return info.min >= 0 and info.max < vocab_size


def _pieces(tokens: np.ndarray):
    """(start, array) of consecutive pieces of a 1-D token array."""
    n, step = tokens.size, SCAN_PIECE_TOKENS
    filename = getattr(tokens, "filename", None)
    if not (isinstance(tokens, np.memmap) and filename and tokens.flags.c_contiguous):
        for start in range(0, n, step):
            yield start, np.asarray(tokens[start:start + step])
        return
    buf = np.empty(min(n, step), tokens.dtype)
    with open(filename, "rb", buffering=0) as f:
        f.seek(tokens.offset)
        for start in range(0, n, step):
            piece = buf[:min(step, n - start)]
            view = memoryview(piece.view(np.uint8))
            got = 0
            while got < len(view):
                k = f.readinto(view[got:])
                if not k:
                    raise ConfigError(f"--data {filename} ended early at token {start:,}; "
                                      "the file is truncated")
                got += k
            yield start, piece


KINDS = "a text (.txt/.md), .npy, .bin or .parquet file"


def check_regular_file(path: Path) -> None:
    """Refuse, naming the path, what is not a non-empty regular file: a missing path, a device
    such as /dev/zero (endless, so never a token file), a FIFO or socket, or an empty file (which
    NumPy's loaders report as EOFError or 'cannot mmap an empty file', without the path)."""
    if not path.exists():
        raise ConfigError(f"--data {path} does not exist; pass {KINDS}")
    if not path.is_file():
        raise ConfigError(f"--data {path} is not a regular file (a device, FIFO or socket); "
                          f"pass {KINDS}")
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"--data {path} cannot be read ({exc.strerror}); check its "
                          "permissions or pass another file") from None
    if size == 0:
        raise ConfigError(f"--data {path} is empty (0 bytes); pass a file that holds tokens")


NPY_MAGIC = b"\x93NUMPY"


def _npy_tokens(path: Path) -> np.ndarray:
    """A .npy file's 1-D integer array, memory-mapped; ConfigError naming the file for anything
    else (no .npy header, a truncated header, pickled objects, another dtype or shape)."""
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic != NPY_MAGIC:
        raise ConfigError(f"--data {path} is not a NumPy .npy file (it does not start with "
                          "NumPy's header); write token ids with numpy.save(path, "
                          "tokens_as_1d_int_array), or name raw uint16 tokens *.bin")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        text = str(exc)
        if "pickle" in text or "object" in text.lower():
            raise ConfigError(f"--data {path} holds Python objects, not token ids; a token file "
                              "is a 1-D integer array saved with numpy.save") from None
        raise ConfigError(f"--data {path} is a truncated or damaged .npy file ({text}); write "
                          "it again with numpy.save") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{path} holds {tokens.dtype} of shape {tokens.shape}; a token "
                          "file must be a 1-D integer array")
    return tokens


def _bin_tokens(path: Path) -> np.ndarray:
    size = path.stat().st_size
    head = np.fromfile(path, np.int32, count=3) if size >= 12 else np.zeros(0, np.int32)
    if head.size == 3 and head[0] == LLMC_MAGIC:
        if head[1] not in (1, 2):
            raise ConfigError(f"{path}: llm.c header version {head[1]} is unknown; 1 (uint16) "
                              "and 2 (uint32) are read")
        dtype = np.uint16 if head[1] == 1 else np.uint32
        count = int(head[2])
        if _LLMC_HEADER_BYTES + count * np.dtype(dtype).itemsize > size:
            raise ConfigError(f"{path}: header says {count} tokens but the file is {size} "
                              "bytes; the file is truncated")
        return np.memmap(path, dtype, mode="r", offset=_LLMC_HEADER_BYTES, shape=(count,))
    dtype = np.dtype(np.uint32 if path.name.endswith((".u32.bin", ".uint32.bin")) else np.uint16)
    if size % dtype.itemsize:
        raise ConfigError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return np.memmap(path, dtype, mode="r")


def _check_bytes_vocab(vocab_size: int, what: str) -> None:
    if vocab_size < BYTE_VOCAB:
        raise ConfigError(f"{what} is byte-level text (ids 0..255) but the model's vocab_size "
                          f"is {vocab_size}; use a model with vocab_size >= {BYTE_VOCAB}")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
