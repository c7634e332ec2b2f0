"""The records of a user's data as they come, before tokenisation: plain text files (one document
each, cut into pieces at line starts so a large file never becomes one huge string), JSONL (a
text field, or chat `messages`), Parquet or Arrow files (a text column, or a messages column),
and folders of any of these. Each record names where it came from (file:line, file:row), so
every refusal points at it. Never tokenises, never writes.

Order: files sorted by path (a folder is walked recursively, hidden entries skipped), records in
file order."""

from __future__ import annotations

import dataclasses
import json
import mmap
import re
from pathlib import Path
from typing import Iterator

from dataflow.models.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
PIECE_CHARS = 1 << 16
"""A text file longer than this is read in pieces of about this many bytes, each ending at a
newline that an ASCII letter follows: the common tokenizers' pre-tokenisers split there anyway,
so the ids match encoding the file whole. A tokenizer that prepends a space to its input, as
Llama 2's SentencePiece does, would differ at each cut: its files are read whole
(plan_slices(cut_text=False), Tokenizer.cuts_cleanly)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    where: str
    """file:line or file:row, for messages."""
    text: str | None = None
    messages: list | None = None
    continues: bool = False
    """This piece continues the previous record's document (a large text file's later piece)."""
    size: int = 0
    """Bytes of input it came from (progress)."""


@dataclasses.dataclass(frozen=True)
class Fields:
    text: str = "text"
    messages: str = "messages"


def data_files(path: str | Path) -> list[Path]:
    """The files of a data path (--data, dataflow-data's DATA: a file, or every text/JSONL/Parquet/Arrow file under a folder),
    sorted; ConfigError naming the path when there are none."""
    path = Path(path)
    known = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES
    if not path.exists():
        raise ConfigError(f"data {path} does not exist; pass a text file or folder, JSONL, "
                          "Parquet or Arrow")
    if path.is_file():
        if path.suffix not in known:
            raise ConfigError(f"data {path}: unknown kind of file '{path.suffix}'; text "
                              f"({', '.join(TEXT_SUFFIXES)}), JSONL, Parquet or Arrow is "
                              "tokenised; .npy and .bin are token ids")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in known
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"data {path}: no text ({', '.join(TEXT_SUFFIXES)}), JSONL, Parquet "
                          "or Arrow files under it")
    return files


@dataclasses.dataclass(frozen=True, slots=True)
class FileSlice:
    """Bytes [start, end) of a text or JSONL file, cut where a record (a JSONL line) or a text
    piece ends: a unit of tokenising work a worker reads itself, so the main process never
    parses or pickles the records."""

    path: Path
    kind: str
    """'text', 'jsonl' or 'parquet'."""
    start: int
    end: int
    """Bytes; for Parquet, start is the row group and end - start its share of the file's
    bytes (for progress)."""
    first_line: int
    """The 1-based line number at start (JSONL); the first row (Parquet, 0-based)."""

    @property
    def size(self) -> int:
        return self.end - self.start


_TEXT_CUT = re.compile(rb"\n[A-Za-z]")


def plan_slices(files: list[Path], unit_bytes: int, fields: Fields = Fields(),
                cut_text: bool = True):
    """The work of `files` in order: a FileSlice per text piece (about PIECE_CHARS bytes, cut at
    a newline a letter follows; the whole file when not cut_text), per about unit_bytes of JSONL
    lines and per Parquet row group, else (Arrow, a .json array) lists of Records read here of
    about unit_bytes each."""
    for f in files:
        if f.suffix in TEXT_SUFFIXES and not cut_text:
            if f.stat().st_size:
                yield FileSlice(f, "text", 0, f.stat().st_size, 1)
            continue
        if f.suffix in TEXT_SUFFIXES or (f.suffix in JSONL_SUFFIXES and not _is_json_array(f)):
            yield from _slices(f, unit_bytes)
            continue
        if f.suffix == ".parquet":
            yield from _row_groups(f, fields)
            continue
        unit, size = [], 0
        records = _jsonl_records(f, fields) if f.suffix in JSONL_SUFFIXES else \
            _table_records(f, fields)
        for r in records:
            unit.append(r)
            size += r.size
            if size >= unit_bytes:
                yield unit
                unit, size = [], 0
        if unit:
            yield unit


def _slices(f: Path, unit_bytes: int):
    text = f.suffix in TEXT_SUFFIXES
    step = PIECE_CHARS if text else unit_bytes
    n = f.stat().st_size
    if n == 0:
        return
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        start, line = 0, 1
        while start < n:
            if start + step >= n:
                end = n
            elif text:
                m = _TEXT_CUT.search(mm, start + step)
                end = m.start() + 1 if m else n
            else:
                nl = mm.find(b"\n", start + step)
                end = nl + 1 if nl >= 0 else n
            yield FileSlice(f, "text" if text else "jsonl", start, end, line)
            if not text:
                line += mm[start:end].count(b"\n")
            start = end


def read_slice(s: FileSlice, fields: Fields = Fields()) -> Iterator[Record]:
    """The records of a FileSlice (ConfigError naming the file and line, or byte)."""
    data = b""
    if s.kind != "parquet":
        with open(s.path, "rb") as fh:
            fh.seek(s.start)
            data = fh.read(s.size)
    if s.kind == "text":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{s.path}: byte {s.start + exc.start:,} is not UTF-8 "
                              f"({exc.reason}); text data must be UTF-8") from None
        yield Record(f"{s.path}", text=text, continues=s.start > 0, size=s.size)
        return
    if s.kind == "parquet":
        yield from _row_group_records(s, fields)
        return
    for k, line in enumerate(data.split(b"\n")):  # as `for line in file`: only \n ends one
        yield from _jsonl_line(line, f"{s.path}:{s.first_line + k}", fields)


def read_records(files: list[Path], fields: Fields = Fields()) -> Iterator[Record]:
    """Every record of `files` in order (what the tokenising workers read, in one process)."""
    for work in plan_slices(files, 1 << 18, fields):
        if isinstance(work, FileSlice):
            yield from read_slice(work, fields)
        else:
            yield from work


def _is_json_array(f: Path) -> bool:
    with open(f, "rb") as fh:
        return f.suffix == ".json" and fh.read(1) == b"["


def _jsonl_records(f: Path, fields: Fields) -> Iterator[Record]:
    with open(f, "rb") as fh:
        first = fh.read(1)
        fh.seek(0)
        if first == b"[" and f.suffix == ".json":  # a JSON array of records
            for i, obj in enumerate(_load_json(fh, f)):
                yield _object_record(obj, f"{f}:record {i}", fields, 0)
            return
        for line_no, line in enumerate(fh, 1):
            yield from _jsonl_line(line, f"{f}:{line_no}", fields)


def _jsonl_line(line: bytes, where: str, fields: Fields) -> Iterator[Record]:
    if not line.strip():
        return
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a JSON object ({exc}); JSONL holds one JSON object "
                          "per line") from None
    yield _object_record(obj, where, fields, len(line))


def _load_json(fh, f):
    try:
        data = json.load(fh)
    except ValueError as exc:
        raise ConfigError(f"{f}: not valid JSON ({exc})") from None
    return data


def _object_record(obj, where: str, fields: Fields, size: int) -> Record:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, got "
                          f"{type(obj).__name__}")
    if fields.messages in obj:
        return Record(where, messages=obj[fields.messages], size=size)
    text = obj.get(fields.text)
    if isinstance(text, str):
        return Record(where, text=text, size=size)
    if fields.text in obj:
        raise ConfigError(f"{where}: field '{fields.text}' is {type(text).__name__}, not a string")
    keys = ", ".join(sorted(obj)[:8]) or "none"
    raise ConfigError(f"{where}: the record has neither a '{fields.text}' nor a "
                      f"'{fields.messages}' field (its fields: {keys}); name the field with "
                      "--text-field or --messages-field")


def _row_groups(f: Path, fields: Fields):
    """A FileSlice per row group of a Parquet file (its columns checked here, once)."""
    pf, column = _parquet_column(f, fields)
    meta, row = pf.metadata, 0
    per = max(1, f.stat().st_size // max(1, meta.num_row_groups))
    for g in range(meta.num_row_groups):
        yield FileSlice(f, "parquet", g, g + per, row)  # end - start: its share, for progress
        row += meta.row_group(g).num_rows


def _parquet_column(f: Path, fields: Fields):
    # pyarrow adds about 0.2 s to the import: loaded only for Parquet data
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{f}: not a readable parquet file ({exc})") from None
    return pf, _column(f, pf.schema_arrow.names, fields)


def _column(f: Path, names, fields: Fields) -> str:
    column = fields.messages if fields.messages in names else fields.text
    if column not in names:
        raise ConfigError(f"{f}: no column '{fields.text}' or '{fields.messages}' (its columns: "
                          f"{', '.join(names[:8])}); name it with --text-field or "
                          "--messages-field, or write token ids in a 'tokens' column")
    return column


def _row_group_records(s: FileSlice, fields: Fields) -> Iterator[Record]:
    pf, column = _parquet_column(s.path, fields)
    batch = pf.read_row_group(s.start, columns=[column])
    yield from _column_records(s.path, column, fields, batch.column(0).to_pylist(),
                               s.first_line, s.size)


def _column_records(f: Path, column: str, fields: Fields, values, row: int, size: int):
    """The records of one column's values, the first at row `row`."""
    each = size // max(1, len(values))
    for k, v in enumerate(values):
        where = f"{f}:row {row + k}"
        if column == fields.messages:
            yield Record(where, messages=v, size=each)
        elif v is None:
            continue  # a null text is an empty document
        elif not isinstance(v, str):
            raise ConfigError(f"{where}: column '{column}' holds {type(v).__name__}, not text")
        else:
            yield Record(where, text=v, size=each)


def _table_records(f: Path, fields: Fields) -> Iterator[Record]:
    """The records of an Arrow IPC file (read whole, here)."""
    # pyarrow adds about 0.2 s to the import: loaded only for Arrow data
    import pyarrow as pa

    try:
        table = _arrow_table(pa, f)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{f}: not a readable {f.suffix[1:]} file ({exc})") from None
    column = _column(f, table.schema.names, fields)
    row = 0
    for batch in table.select([column]).to_batches():
        yield from _column_records(f, column, fields, batch.column(0).to_pylist(), row,
                                   batch.nbytes)
        row += batch.num_rows


def _arrow_table(pa, f: Path):
    import pyarrow.ipc  # Arrow IPC files only

    try:
        return pyarrow.ipc.open_file(f).read_all()
    except pa.ArrowInvalid:
        return pyarrow.ipc.open_stream(f).read_all()


def table_has_tokens(path: Path) -> bool:
    """A Parquet file (or folder of them) with a 'tokens' column: pre-tokenised, read as token
    ids (dataflow.data.arrow), not tokenised."""
    # pyarrow: only when a Parquet path is given
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files or not all(f.suffix == ".parquet" for f in files):
        return False
    try:
        return "tokens" in pq.read_schema(files[0]).names
    except Exception:  # unreadable: the tokenising path names the file
        return False
