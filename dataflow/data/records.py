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
from pathlib import Path
from typing import Iterator

from dataflow.models.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
PIECE_CHARS = 1 << 16
"""A text file longer than this is read in pieces of about this many characters, each ending at
a newline that a letter follows: the common tokenizers' pre-tokenisers split there anyway, so the
ids match encoding the file whole (a tokenizer that prepends a space to its input, as Llama 2's
SentencePiece does, differs at each cut)."""


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
    """The files of --data (a file, or every text/JSONL/Parquet/Arrow file under a folder),
    sorted; ConfigError naming the path when there are none."""
    path = Path(path)
    known = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES
    if not path.exists():
        raise ConfigError(f"--data {path} does not exist")
    if path.is_file():
        if path.suffix not in known:
            raise ConfigError(f"--data {path}: unknown kind of file '{path.suffix}'; text "
                              f"({', '.join(TEXT_SUFFIXES)}), JSONL, Parquet or Arrow is "
                              "tokenised; .npy and .bin are token ids")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in known
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"--data {path}: no text ({', '.join(TEXT_SUFFIXES)}), JSONL, Parquet "
                          "or Arrow files under it")
    return files


def read_records(files: list[Path], fields: Fields = Fields()) -> Iterator[Record]:
    for f in files:
        if f.suffix in TEXT_SUFFIXES:
            yield from _text_records(f)
        elif f.suffix in JSONL_SUFFIXES:
            yield from _jsonl_records(f, fields)
        else:
            yield from _table_records(f, fields)


def _text_records(f: Path) -> Iterator[Record]:
    try:
        text = f.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{f}: byte {exc.start:,} is not UTF-8 ({exc.reason}); text data "
                          "must be UTF-8") from None
    for i, (piece, size) in enumerate(_pieces(text)):
        yield Record(f"{f}", text=piece, continues=i > 0, size=size)


def _pieces(text: str):
    """(piece, its UTF-8 size) of `text` cut as PIECE_CHARS says."""
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = end
            while cut < len(text) and not (text[cut - 1] == "\n" and text[cut].isalpha()):
                cut += 1
            end = cut
        piece = text[start:end]
        yield piece, len(piece.encode("utf-8"))
        start = end


def _jsonl_records(f: Path, fields: Fields) -> Iterator[Record]:
    with open(f, "rb") as fh:
        first = fh.read(1)
        fh.seek(0)
        if first == b"[" and f.suffix == ".json":  # a JSON array of records
            for i, obj in enumerate(_load_json(fh, f)):
                yield _object_record(obj, f"{f}:record {i}", fields, 0)
            return
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{f}:{line_no}: not a JSON object ({exc}); JSONL holds one "
                                  "JSON object per line") from None
            yield _object_record(obj, f"{f}:{line_no}", fields, len(line))


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


def _table_records(f: Path, fields: Fields) -> Iterator[Record]:
    # pyarrow adds about 0.2 s to the import: loaded only for Parquet and Arrow data
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.suffix == ".parquet":
            pf = pq.ParquetFile(f)
            names, batches = pf.schema_arrow.names, lambda cols: pf.iter_batches(columns=cols)
        else:
            table = _arrow_table(pa, f)
            names, batches = table.schema.names, lambda cols: table.select(cols).to_batches()
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{f}: not a readable {f.suffix[1:]} file ({exc})") from None
    column = fields.messages if fields.messages in names else fields.text
    if column not in names:
        raise ConfigError(f"{f}: no column '{fields.text}' or '{fields.messages}' (its columns: "
                          f"{', '.join(names[:8])}); name it with --text-field or "
                          "--messages-field, or write token ids in a 'tokens' column")
    row = 0
    for batch in batches([column]):
        values = batch.column(0).to_pylist()
        size = batch.nbytes // max(1, len(values))
        for v in values:
            where = f"{f}:row {row}"
            row += 1
            if column == fields.messages:
                yield Record(where, messages=v, size=size)
            elif v is None:
                continue  # a null text is an empty document
            elif not isinstance(v, str):
                raise ConfigError(f"{where}: column '{column}' holds {type(v).__name__}, not text")
            else:
                yield Record(where, text=v, size=size)


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
