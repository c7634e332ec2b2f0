"""Durable, hashed file writes: the one helper behind the model directory (dataflow.models.storage)
and the training checkpoint (dataflow.checkpoint), which both write every file of a temporary
directory this way before renaming it into place. Never renames, never deletes, and never
returns a digest for bytes that did not reach the file (a failed write raises its OSError)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

PIECE_BYTES = 64 << 20
"""Bytes are written and hashed in 64 MiB pieces: hashlib releases the GIL on a piece that large,
so a thread pool of writers keeps the cores busy, and a piece is still in cache when hashed."""


def write_hashed(path: Path, data: memoryview) -> str:
    """Write `data` to a new file at `path` (truncating one there), fsync it, and return the
    sha256 hex digest of the bytes written. `data`: a flat byte view (e.g. the uint8 view of a
    contiguous block); written piece by piece, each piece hashed after it is written."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, len(data), PIECE_BYTES):
            piece = data[start : start + PIECE_BYTES]
            f.write(piece)
            digest.update(piece)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()
