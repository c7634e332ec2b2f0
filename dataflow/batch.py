"""A trainer's batch as the executor stages it: input ids, targets (the labels, -100 where not
counted), RoPE positions (restarting at every document of a packed row) and the attention
segments of each chunk of each round. Checks the trainer's arrays and names what is wrong; never
touches a device and never decides placement.

Conventions (transformers'): `tokens`, `labels`, `doc_ids` and `position_ids` all have the
shape (rows, seqlen + 1) of the token ids. Inputs are tokens[:, :-1]; the target of input j is
labels[:, j + 1] (tokens[:, j + 1] without labels), so labels are shifted inside, as
LlamaForCausalLM shifts them. A document starts wherever doc_ids change, or wherever the position
ids do not continue (p[j] != p[j - 1] + 1); attention never crosses a start, and RoPE uses the
position inside the document (with position_ids: the given ids). Without labels, the last token
of a document predicts nothing (its target is the next document's first token).

Each of them may be an array (NumPy, CuPy, anything with __array__ or __dlpack__) or a list of
equal-length lists of ids, as a tokenizer's input_ids come without return_tensors: taken as the
array NumPy makes of it (the same bits), ragged rows refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow.layer_ops import ChunkInfo
from dataflow.kernels.reference import IGNORE
from dataflow.memplan.plan.plan import Chunking
from dataflow.models.errors import ConfigError

MAX_POSITION = (1 << 31) - 1
"""Position ids travel as int32."""


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    ids: np.ndarray
    """(rows, seqlen) int32 input ids."""
    targets: np.ndarray
    """(rows, seqlen) int32 targets, IGNORE (-100) where nothing is learnt."""
    positions: np.ndarray
    """(rows, seqlen) int32 RoPE positions."""
    doc_starts: tuple[np.ndarray, ...] | None
    """Per row, the input columns (> 0) where a new document starts; None: one per row."""
    counted: int
    """Targets that count in the loss (not IGNORE)."""

    @property
    def rows(self) -> int:
        return self.ids.shape[0]


def _as_int_array(name: str, value, want: tuple[int, int] | None) -> np.ndarray:
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        try:
            value = np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError):
            value = value.get() if hasattr(value, "get") else np.asarray(value)
    try:  # a list of equal-length lists of ids (a tokenizer's input_ids) is taken as its array
        arr = np.asarray(value)
    except ValueError:  # NumPy refuses ragged nesting: rows of different lengths
        lengths = sorted({len(r) for r in value if hasattr(r, "__len__")}) \
            if isinstance(value, (list, tuple)) else []
        shown = ", ".join(map(str, lengths[:4])) + (", ..." if len(lengths) > 4 else "")
        raise ConfigError(f"{name} is a nested list whose rows have different lengths "
                          f"({shown}); "
                          "every row holds seqlen + 1 ids: pad or pack the rows to one "
                          "length") from None
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{name} must be a 2-D integer array, got shape {arr.shape} dtype "
                          f"{arr.dtype}")
    if want is not None and arr.shape != want:
        raise ConfigError(f"{name} has shape {arr.shape}; it must have the shape of the tokens, "
                          f"{want} (rows, seqlen + 1)")
    return arr


def make_batch(tokens, labels=None, *, doc_ids=None, position_ids=None, vocab_size: int,
               rows: int | None = None, seqlen: int, pad_rows_to: int = 1) -> Batch:
    """Check the trainer's arrays and build the Batch. `rows`: the number of rows required
    (None: any); `pad_rows_to`: append rows that count nothing (token 0, every target ignored)
    up to a multiple of this (an evaluation's partial last round)."""
    tok = _as_int_array("tokens", tokens, None)
    if tok.shape[1] != seqlen + 1 or (rows is not None and tok.shape[0] != rows) \
            or tok.shape[0] < 1:
        want = f"({rows if rows is not None else 'rows'}, {seqlen + 1})"
        raise ConfigError(f"tokens have shape {tok.shape}; this plan takes {want} "
                          "(seqs_per_step, seqlen + 1)")
    if tok.min() < 0 or tok.max() >= vocab_size:
        bad = tok[(tok < 0) | (tok >= vocab_size)][0]
        raise ConfigError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if doc_ids is not None and position_ids is not None:
        raise ConfigError("pass doc_ids or position_ids, not both (each marks the documents)")
    new_doc = None  # (rows, seqlen + 1) bool: column j starts a document (j > 0)
    positions = None
    if doc_ids is not None:
        d = _as_int_array("doc_ids", doc_ids, tok.shape)
        new_doc = np.zeros(tok.shape, bool)
        new_doc[:, 1:] = d[:, 1:] != d[:, :-1]
    elif position_ids is not None:
        p = _as_int_array("position_ids", position_ids, tok.shape)
        if p.min() < 0 or p.max() > MAX_POSITION:
            bad = p[(p < 0) | (p > MAX_POSITION)][0]
            raise ConfigError(f"position id {bad} is outside [0, {MAX_POSITION}]")
        new_doc = np.zeros(tok.shape, bool)
        new_doc[:, 1:] = p[:, 1:] != p[:, :-1] + 1
        positions = p[:, :-1]
    if labels is not None:
        lab = _as_int_array("labels", labels, tok.shape)
        tgt = lab[:, 1:]
        bad = (tgt != IGNORE) & ((tgt < 0) | (tgt >= vocab_size))
        if bad.any():
            raise ConfigError(f"label {tgt[bad][0]} is neither a token id in [0, {vocab_size}) "
                              f"nor the ignore index {IGNORE}")
    else:
        tgt = tok[:, 1:]
        if new_doc is not None:  # the last token of a document predicts nothing
            tgt = np.where(new_doc[:, 1:], IGNORE, tgt)
    if new_doc is not None and positions is None:
        col = np.broadcast_to(np.arange(seqlen + 1), tok.shape)
        start = np.maximum.accumulate(np.where(new_doc, col, 0), axis=1)
        positions = (col - start)[:, :-1]
    if positions is None:
        positions = np.broadcast_to(np.arange(seqlen), (tok.shape[0], seqlen))
    starts = None
    if new_doc is not None:
        starts = tuple(np.nonzero(row[:-1])[0] for row in new_doc)
    ids = tok[:, :-1]
    pad = -tok.shape[0] % pad_rows_to
    if pad:
        ids = np.concatenate([ids, np.zeros((pad, seqlen), ids.dtype)])
        tgt = np.concatenate([tgt, np.full((pad, seqlen), IGNORE, tgt.dtype)])
        positions = np.concatenate([positions, np.broadcast_to(np.arange(seqlen), (pad, seqlen))])
        if starts is not None:
            starts += tuple(np.zeros(0, np.int64) for _ in range(pad))
    counted = int(np.count_nonzero(tgt != IGNORE))
    return Batch(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(tgt, np.int32),
                 np.ascontiguousarray(positions, np.int32), starts, counted)


def default_chunks(ch: Chunking) -> tuple[ChunkInfo, ...]:
    """The chunks of a round when every row is one document."""
    return tuple(_chunk(ch, c, None) for c in range(ch.chunks_per_round))


def round_chunks(ch: Chunking, batch: Batch, rnd: int) -> tuple[ChunkInfo, ...]:
    """The chunks of round `rnd` with its rows' document boundaries as attention segments."""
    if batch.doc_starts is None:
        return default_chunks(ch)
    per = ch.seqs_per_round
    return tuple(_chunk(ch, c, batch.doc_starts[rnd * per:(rnd + 1) * per])
                 for c in range(ch.chunks_per_round))


def _chunk(ch: Chunking, c: int, starts) -> ChunkInfo:
    t = ch.chunk_tokens
    rows = slice(c * t, (c + 1) * t)
    if ch.chunks_per_seq > 1:
        part = c % ch.chunks_per_seq
        ctx = part * t
        segs = ((0, t, 0),)
        if starts is not None:
            st = starts[c // ch.chunks_per_seq]
            inside = [int(s) - ctx for s in st if ctx < s < ctx + t]
            first = max([0] + [int(s) for s in st if s <= ctx])  # its document's first key
            bounds = [0] + inside + [t]
            segs = tuple((a, b, first if i == 0 else ctx + a)
                         for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
        return ChunkInfo(c, rows, segs, True, ctx, part == 0, part == ch.chunks_per_seq - 1)
    segs = []
    for s in range(ch.seqs_per_chunk):
        off = s * ch.seqlen
        inner = [] if starts is None else [int(x) for x in starts[c * ch.seqs_per_chunk + s]]
        bounds = [0] + inner + [ch.seqlen]
        segs += [(off + a, off + b, off + a) for a, b in zip(bounds, bounds[1:])]
    return ChunkInfo(c, rows, tuple(segs), False, 0, True, True)
