"""The sweep directory on disk: one JSON record per finished cell under cells/ (the source of
truth, written atomically the moment a cell finishes, so a killed sweep loses at most the cell in
flight), and the table rebuilt from them as sweep.parquet and sweep.csv (with a header). Several
sweeps may write into one directory at once: the table is rebuilt from every record on disk under
a lock on the directory, so none loses another's rows. Never runs or plans cells."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import os
import tempfile
from pathlib import Path

from dataflow.bench.sweep.grid import Cell
from dataflow.bench.sweep.record import COLUMNS, DERIVED, SCHEMA_VERSION, CellRecord, column_types
from dataflow.models.errors import ConfigError
from dataflow.precision import PRECISIONS

PARQUET = "sweep.parquet"
CSV = "sweep.csv"
SCHEMA_KEY = b"dataflow_sweep_schema_version"


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file and rename, so a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold an exclusive flock on the directory itself (no lock file is left behind); it is
    released when the descriptor closes, also when the process dies."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class SweepStore:
    """A sweep directory: cells/<slug>.json, logs/, plans/, sweep.parquet, sweep.csv. In a
    precision grid's directory (by_precision: --precision bf16,fp8) every record and log name
    ends in its precision, cells/<slug>-<precision>.json; a one-precision sweep's names do not,
    as before precision was a grid axis."""

    def __init__(self, root: str | os.PathLike, *, by_precision: bool = False):
        self.root = Path(root)
        self.cells_dir = self.root / "cells"
        self.logs_dir = self.root / "logs"
        self.plans_dir = self.root / "plans"
        self.by_precision = by_precision

    def name(self, cell: Cell) -> str:
        """The file name stem of the cell's record and logs."""
        return f"{cell.slug}-{cell.precision}" if self.by_precision else cell.slug

    def record_path(self, cell: Cell) -> Path:
        return self.cells_dir / f"{self.name(cell)}.json"

    def named_by_precision(self) -> bool | None:
        """Whether the records on disk are a precision grid's (names ending in a precision);
        None when there are none. A one-precision slug ends in '-d<budget>', never so."""
        names = [p.stem for p in self.cells_dir.glob("*.json")]
        if not names:
            return None
        return any(n.endswith(tuple(f"-{p}" for p in PRECISIONS)) for n in names)

    def save(self, record: CellRecord) -> None:
        """Persist one finished cell now (idempotent: a later save of the same cell replaces it)."""
        text = json.dumps(record.to_row(), indent=1, sort_keys=False)
        _atomic_write(self.record_path(record.cell), lambda tmp: Path(tmp).write_text(text))

    def load(self) -> dict[Cell, CellRecord]:
        """Every record under cells/, by cell."""
        out = {}
        for path in sorted(self.cells_dir.glob("*.json")):
            try:
                record = CellRecord.from_row(json.loads(path.read_text()))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path}: not a sweep record of schema {SCHEMA_VERSION} "
                                  f"({exc}); move it away or rerun that cell with --redo") from None
            out[record.cell] = record
        return out

    def rebuild_table(self) -> list[CellRecord]:
        """Rewrite sweep.parquet and sweep.csv from every record under cells/ (this sweep's and
        any other's writing into the same directory at the same time); returns those records.

        The read and the write happen under an exclusive lock on the directory, so the table
        written last was read after every writer's last save: concurrent sweeps lose no rows."""
        with _locked(self.root):
            records = list(self.load().values())
            self.write_table(records)
        return records

    def write_table(self, records) -> None:
        """sweep.parquet and sweep.csv from exactly these records, in grid order (callers that
        share the directory use rebuild_table)."""
        rows = [r.to_row() for r in sorted(records, key=lambda r: r.cell.sort_key)]
        _atomic_write(self.root / PARQUET, lambda tmp: _write_parquet(tmp, rows))
        _atomic_write(self.root / CSV, lambda tmp: _write_csv(tmp, rows))


def _arrow_schema():
    import pyarrow as pa

    arrow = {int: pa.int64(), float: pa.float64(), str: pa.string()}
    return pa.schema([(name, arrow[kind]) for name, kind in column_types().items()],
                     metadata={SCHEMA_KEY: str(SCHEMA_VERSION).encode()})


def _write_parquet(path: str, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS) + list(DERIVED))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def read_table(root: str | os.PathLike) -> list[CellRecord]:
    """The records of a sweep directory's sweep.parquet (refusing another schema version)."""
    import pyarrow.parquet as pq

    path = Path(root) / PARQUET
    if not Path(root).is_dir():
        raise ConfigError(f"sweep directory {root} does not exist; give the --out of a "
                          f"`dataflow-sweep run` (e.g. dataflow-sweep run ... --out {root})")
    if not path.exists():
        raise ConfigError(f"no {PARQUET} in {root}; run `dataflow-sweep run ... --out {root}` "
                          "first")
    table = pq.read_table(path)
    version = (table.schema.metadata or {}).get(SCHEMA_KEY, b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise ConfigError(f"{path}: sweep schema version {version}; this version reads "
                          f"{SCHEMA_VERSION} (rerun the sweep to rebuild the table)")
    return [CellRecord.from_row(row) for row in table.to_pylist()]
