"""ArrowTokenDataset: packs pre-tokenised documents from Parquet files (one list-of-integer
column, one row per document) into training rows of seqlen + 1 tokens, deterministically and
resumably. Reads one row group at a time and never holds the whole dataset in memory; never
tokenises, never downloads, and never lets a token id outside [0, vocab_size) through."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataflow.models.errors import ConfigError

_STATE_KEYS = ("dataset", "document", "epoch", "offset")


class ArrowTokenDataset:
    """Documents in file order (files as given, a directory means its *.parquet sorted by name),
    each followed by `eos_id` when one is given, form one endless token stream; epoch e+1 starts
    right after the last document of epoch e. Row i of a batch is the seqlen + 1 tokens from the
    batch's start + i * seqlen, so consecutive rows overlap by one token (inputs row[:-1],
    targets row[1:]; every token is a target once, as in llm.c's loader).

    With shuffle=True each epoch visits the row groups in a seeded random order and the
    documents inside each row group in a seeded random order (a two-level shuffle that reads
    each row group once per epoch instead of once per document). Null rows are empty documents.
    """

    def __init__(
        self,
        files,
        seqlen: int,
        *,
        vocab_size: int,
        column: str = "tokens",
        eos_id: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        for name, value in (("seqlen", seqlen), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ConfigError(
                f"eos_id {eos_id} is outside [0, vocab_size {vocab_size}); "
                "pass an id of the model's vocabulary or None"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self.seqlen, self.vocab_size, self.column = seqlen, vocab_size, column
        self.eos_id, self.shuffle, self.seed = eos_id, shuffle, seed
        self.paths = _expand(files)
        self._files = [pq.ParquetFile(p) for p in self.paths]
        units = []  # (file index, row group, rows, first row of the group in its file)
        for f, (path, pf) in enumerate(zip(self.paths, self._files)):
            _check_column(pf.schema_arrow, column, path)
            first = 0
            for rg in range(pf.metadata.num_row_groups):
                rows = pf.metadata.row_group(rg).num_rows
                if rows:
                    units.append((f, rg, rows, first))
                first += rows
        self._units = units
        self._unit_rows = np.array([u[2] for u in units], np.int64)
        self.n_documents = int(self._unit_rows.sum())
        if self.n_documents == 0:
            raise ConfigError(
                f"no documents in {[str(p) for p in self.paths]}; pass Parquet "
                "files with at least one row"
            )
        ident = [[p.name, pf.metadata.num_rows] for p, pf in zip(self.paths, self._files)]
        ident += [column, eos_id, shuffle, seed]
        self._fingerprint = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
        self._order_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._unit_cache: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None
        self._perm_cache: tuple[tuple[int, int], np.ndarray] | None = None
        self._pos = (0, 0, 0)  # epoch, document (ordinal in the epoch's order), offset

    # -- public API ------------------------------------------------------------------------

    def next_batch(self, n_seqs: int) -> np.ndarray:
        """The next (n_seqs, seqlen + 1) int32 rows; advances the stream by n_seqs * seqlen."""
        if isinstance(n_seqs, bool) or not isinstance(n_seqs, int) or n_seqs < 1:
            raise ConfigError(f"n_seqs must be a positive integer, got {n_seqs!r}")
        step = n_seqs * self.seqlen
        buf = np.empty(step + 1, np.int32)
        after = self._take(self._pos, step, buf[:step])
        self._take(after, 1, buf[step:])  # the last target, which is the next batch's first input
        self._pos = after
        return np.lib.stride_tricks.as_strided(
            buf, (n_seqs, self.seqlen + 1), (self.seqlen * 4, 4)
        ).copy()

    def state(self) -> dict:
        """JSON-able position: {'epoch', 'document' (ordinal within the epoch's document order),
        'offset' (tokens of that document already used, eos counted), 'dataset' (fingerprint
        of the files, column, eos_id, shuffle and seed)}."""
        epoch, doc, off = self._pos
        return {"dataset": self._fingerprint, "document": doc, "epoch": epoch, "offset": off}

    def load_state(self, state: dict) -> None:
        """Resume from `state()`: the following batches equal those the saving loader would
        have produced next."""
        if not isinstance(state, dict) or sorted(state) != sorted(_STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"loader state has keys {got}; expected {sorted(_STATE_KEYS)}")
        if state["dataset"] != self._fingerprint:
            raise ConfigError(
                f"loader state is for dataset {state['dataset']!r}, this loader "
                f"reads {self._fingerprint!r} (files, column, eos_id, shuffle or "
                "seed differ); build the loader exactly as when it was saved"
            )
        for key in ("epoch", "document", "offset"):
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"loader state {key} must be a non-negative integer, got {v!r}")
        if state["document"] >= self.n_documents:
            raise ConfigError(
                f"loader state document {state['document']} is beyond the "
                f"{self.n_documents} documents of this dataset"
            )
        self._pos = (state["epoch"], state["document"], state["offset"])

    def check_all(self) -> None:
        """Read every row group once and validate its token ids (the loader otherwise checks
        each row group when it first reads it)."""
        for unit in range(len(self._units)):
            self._load_unit(unit)

    # -- internals -------------------------------------------------------------------------

    def _take(self, pos: tuple[int, int, int], count: int, out: np.ndarray):
        """Copy `count` stream tokens from `pos` into `out`; return the position after them."""
        epoch, doc, off = pos
        eos = self.eos_id is not None
        filled, idle_docs = 0, 0
        while filled < count:
            toks = self._doc_tokens(epoch, doc)
            length = toks.size + eos
            k = min(length - off, count - filled)
            if k > 0:
                body = max(0, min(off + k, toks.size) - off)
                out[filled : filled + body] = toks[off : off + body]
                if body < k:
                    out[filled + k - 1] = self.eos_id
                filled, off, idle_docs = filled + k, off + k, 0
            if off >= length:
                doc, off, idle_docs = doc + 1, 0, idle_docs + (length == 0)
                if doc == self.n_documents:
                    epoch, doc = epoch + 1, 0
                if idle_docs > self.n_documents:
                    raise ConfigError(
                        f"the {self.n_documents} documents hold no tokens; "
                        "pass non-empty documents or an eos_id"
                    )
        return epoch, doc, off

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Row-group order of an epoch and the first document ordinal of each."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self._units)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            starts = np.concatenate([[0], np.cumsum(self._unit_rows[order])])
            self._order_cache = (epoch, order, starts)
        return self._order_cache[1], self._order_cache[2]

    def _doc_tokens(self, epoch: int, doc: int) -> np.ndarray:
        order, starts = self._epoch_order(epoch)
        slot = int(np.searchsorted(starts, doc, side="right")) - 1
        unit = int(order[slot])
        values, offsets = self._load_unit(unit)
        local = doc - int(starts[slot])
        if self.shuffle:
            if self._perm_cache is None or self._perm_cache[0] != (epoch, unit):
                rng = np.random.default_rng([self.seed, epoch, unit, 1])
                self._perm_cache = ((epoch, unit), rng.permutation(self._units[unit][2]))
            local = int(self._perm_cache[1][local])
        return values[offsets[local] : offsets[local + 1]]

    def _load_unit(self, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """Flat int32 token ids and (rows + 1) offsets of one row group, validated, cached."""
        f, rg, _, first = self._units[unit]
        if self._unit_cache is not None and self._unit_cache[0] == (f, rg):
            return self._unit_cache[1], self._unit_cache[2]
        arr = self._files[f].read_row_group(rg, columns=[self.column]).column(0)
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        if arr.null_count:
            arr = arr.fill_null(pa.scalar([], type=arr.type))
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        offsets -= offsets[0]
        bad = np.flatnonzero((values < 0) | (values >= self.vocab_size))
        if bad.size:
            row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
            raise ConfigError(
                f"token id {int(values[bad[0]])} in {self.paths[f]}, column '{self.column}', "
                f"row {first + row} (row group {rg}), position {int(bad[0] - offsets[row])} is "
                f"outside [0, vocab_size {self.vocab_size}); use a model whose vocab_size "
                "covers the tokenizer, or re-tokenise the data"
            )
        values = values.astype(np.int32, copy=False)
        self._unit_cache = ((f, rg), values, offsets)
        return values, offsets


def _expand(files) -> list[Path]:
    items = [files] if isinstance(files, (str, Path)) else list(files)
    paths: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.parquet"))
            if not found:
                raise ConfigError(f"directory {p} holds no *.parquet files; pass Parquet files")
            paths += found
        elif p.is_file():
            paths.append(p)
        else:
            raise ConfigError(
                f"token file {p} does not exist; pass Parquet files or a directory of them"
            )
    if not paths:
        raise ConfigError("no token files given; pass at least one Parquet file")
    return paths


def _check_column(schema: pa.Schema, column: str, path: Path) -> None:
    if column not in schema.names:
        raise ConfigError(
            f"{path} has no column '{column}'; its columns are {schema.names}; "
            "pass column=<name of the token-id list column>"
        )
    typ = schema.field(column).type
    if not (
        (pa.types.is_list(typ) or pa.types.is_large_list(typ))
        and pa.types.is_integer(typ.value_type)
    ):
        raise ConfigError(
            f"{path} column '{column}' has type {typ}; expected a list of "
            "integer token ids per row (list<int32> or list<int64>)"
        )
