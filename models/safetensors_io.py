"""A small reader and streaming writer of the safetensors format: 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}} padded
with spaces to 8 bytes, then the raw little-endian tensor bytes. The reader memory-maps the file
and hands out one tensor at a time; the writer takes tensors one at a time in header order. Both
handle bf16 through ml_dtypes, so neither needs torch nor the `safetensors` package (whose NumPy
bf16 support depends on its version). Never reads a byte outside the data a header declares."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from dataflow.models.errors import ConfigError

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"), "U64": np.dtype("<u8"), "BOOL": np.dtype("?"),
}
_MAX_HEADER_BYTES = 100 << 20
"""The format's own limit (the Rust implementation refuses larger headers)."""


def dtype_code(dtype) -> str:
    """The safetensors code ('BF16', 'F32', ...) of a NumPy dtype."""
    dtype = np.dtype(dtype)
    for code, dt in DTYPES.items():
        if dt == dtype:
            return code
    raise ConfigError(f"dtype {dtype} has no safetensors code; supported: {sorted(DTYPES)}")


class SafetensorsFile:
    """A safetensors file opened read-only and memory-mapped: `tensor(name)` returns a read-only
    view of its bytes (nothing is read until the view is touched)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{self.path} is not a safetensors file: {size} bytes, too "
                                  "short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"{self.path} is not a safetensors file (or is truncated): "
                                  f"header length {n} exceeds the file's {size} bytes")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{self.path}: safetensors header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{self.path}: safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_bytes = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape = DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{self.path}: tensor '{name}' has a bad header entry {e!r}; "
                                  f"dtypes known: {sorted(DTYPES)}") from None
            want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if not 0 <= begin <= end <= data_bytes or end - begin != want:
                raise ConfigError(f"{self.path}: tensor '{name}' {e['dtype']}{list(shape)} "
                                  f"declares bytes [{begin}, {end}) but needs {want} within "
                                  f"the {data_bytes} data bytes; the file is damaged")
            self._entries[name] = (dtype, shape, begin, end)
        self._map = None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def tensor(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name` in its stored dtype and shape."""
        dtype, shape, begin, end = self._entry(name)
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        data = self._map[self._data_start + begin:self._data_start + end]
        return data.view(dtype).reshape(shape)

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"{self.path} has no tensor '{name}'") from None


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are declared up front (name, dtype, shape) and
    then given one at a time in that order, so a file of any size is written with one tensor in
    memory. `close()` refuses a file with a tensor left unwritten."""

    def __init__(self, path: str | Path, specs, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, offset = {}, 0
        self._specs = []
        for name, dtype, shape in specs:
            dtype, shape = np.dtype(dtype), tuple(int(s) for s in shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": dtype_code(dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._specs.append((name, dtype, shape))
            offset += nbytes
        if metadata:
            header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self.nbytes = 8 + len(raw) + offset

    def write(self, name: str, array: np.ndarray) -> None:
        if self._next >= len(self._specs):
            raise ConfigError(f"{self.path}: tensor '{name}' was not declared")
        want_name, dtype, shape = self._specs[self._next]
        array = np.asarray(array)
        if name != want_name or array.dtype != dtype or array.shape != shape:
            raise ConfigError(f"{self.path}: expected tensor '{want_name}' {dtype}{list(shape)} "
                              f"next, got '{name}' {array.dtype}{list(array.shape)}")
        self._file.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._next != len(self._specs):
            raise ConfigError(f"{self.path}: {len(self._specs) - self._next} declared tensors "
                              f"were never written (next: '{self._specs[self._next][0]}')")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def save_file(tensors: dict[str, np.ndarray], path: str | Path,
              metadata: dict[str, str] | None = None) -> None:
    """Write a dict of arrays as one safetensors file (convenience for small files)."""
    specs = [(k, v.dtype, v.shape) for k, v in tensors.items()]
    with SafetensorsWriter(path, specs, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
