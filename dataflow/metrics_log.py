"""The run log: one row per training step (throughput from the engine's StepResult, the step's
breakdown from dataflow.instrument, PCIe counter deltas when a GPU gives them) appended to a
Parquet or CSV file chosen by extension, plus the run's metadata once (commit, package version,
device, driver, CuPy/CUDA versions, plan hash, config). Several runs may share one file; rows
carry their run_id. Never touches a device beyond reading version strings."""

from __future__ import annotations

import csv
import dataclasses
import enum
import importlib.metadata
import json
import os
import platform
import subprocess
import time
import uuid
from pathlib import Path

from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_dict

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("run_id", "string", "the run this row belongs to (its entry in the run metadata)"),
    ("time_unix_s", "float64", "when the row was written, seconds since the Unix epoch"),
    ("step", "int64", "optimizer step, 1-based"),
    ("loss", "float64", "mean next-token cross-entropy over the step's tokens"),
    ("tokens", "int64", "tokens trained this step"),
    ("step_time_s", "float64", "the engine's host-clock step time"),
    ("tok_per_s", "float64", "tokens / step_time_s"),
    ("model_tflop_per_s", "float64", "model FLOPs (FLOP model) / step_time_s / 1e12"),
    ("mfu", "float64", "model FLOP/s over the profile's peak bf16 FLOP/s, fraction"),
    ("hfu", "float64", "model + recompute FLOP/s over peak, fraction"),
    ("flop_model_version", "string", "version of models/flops.py that counted the FLOPs"),
    ("lr", "float64", "learning rate of this step"),
    ("grad_norm", "float64", "global gradient norm when clipping is on, else empty"),
    ("h2d_bytes", "int64", "bytes copied host to device this step (engine's count)"),
    ("d2h_bytes", "int64", "bytes copied device to host this step (engine's count)"),
    ("clock", "string", "breakdown time source: cuda_events or host"),
    ("wall_s", "float64", "breakdown window: begin_step to the end-of-step sync"),
    ("compute_busy_s", "float64", "union of compute-stream spans (part 1 of wall_s)"),
    ("copy_exposed_s", "float64", "copy time with the compute stream idle (part 2)"),
    ("host_exposed_s", "float64", "HOST-stream time with no compute or copy (part 3)"),
    ("idle_s", "float64", "time nothing traced ran (part 4)"),
    ("compute_idle_s", "float64", "compute-stream bubble: wall_s - compute_busy_s"),
    ("h2d_busy_s", "float64", "union of H2D spans"),
    ("d2h_busy_s", "float64", "union of D2H spans"),
    ("host_busy_s", "float64", "union of HOST-stream spans"),
    ("copy_busy_s", "float64", "union of H2D and D2H spans"),
    ("copy_hidden_s", "float64", "copy time overlapping compute"),
    ("copy_hidden_frac", "float64", "copy_hidden_s / copy_busy_s, fraction"),
    ("h2d_exposed_s", "float64", "H2D time with the compute stream idle"),
    ("d2h_exposed_s", "float64", "D2H time with the compute stream idle"),
    ("h2d_bytes_per_s", "float64", "traced H2D bytes / h2d_busy_s"),
    ("d2h_bytes_per_s", "float64", "traced D2H bytes / d2h_busy_s"),
    ("recompute_s", "float64", "union of backward spans re-running forward work the "
     "saved-activation level left out"),
    ("recompute_frac", "float64", "recompute_s / compute_busy_s, fraction"),
    ("optimizer_s", "float64", "union of optimizer spans on any stream"),
    ("optimizer_frac", "float64", "optimizer_s / wall_s, fraction"),
    ("n_spans", "int64", "spans traced this step"),
    ("attention_s", "float64", "union of fused-attention spans that are no recompute"),
    ("pcie_h2d_bytes", "int64", "NVML PCIe RX link bytes over the step (headers included), "
     "empty without NVML"),
    ("pcie_d2h_bytes", "int64", "NVML PCIe TX link bytes over the step (headers and H2D read "
     "requests included), empty without NVML"),
    ("aux_loss", "float64", "MoE: the router's load-balancing loss, mean over the step's rounds, "
     "unscaled by its coefficient; empty for a dense model"),
    ("z_loss", "float64", "MoE: the router z-loss, mean over the step's rounds, unscaled; empty "
     "for a dense model"),
)
"""(name, Arrow type, meaning) of every column, in file order; docs/instrumentation.md too."""

COLUMN_NAMES = tuple(c[0] for c in COLUMNS)
OLDER_COLUMN_NAMES = (COLUMN_NAMES[:COLUMN_NAMES.index("aux_loss")],)
"""The columns of earlier versions, each a prefix of COLUMN_NAMES: a log written by one is read
with the newer columns empty, and appending to it first rewrites it with them (empty)."""
FORMATS = (".parquet", ".csv")
_RESULT = ("step", "loss", "tokens", "step_time_s", "tok_per_s", "model_tflop_per_s", "mfu",
           "hfu", "flop_model_version", "lr", "grad_norm", "h2d_bytes", "d2h_bytes", "aux_loss",
           "z_loss")
_BREAKDOWN = COLUMN_NAMES[COLUMN_NAMES.index("clock"):COLUMN_NAMES.index("pcie_h2d_bytes")]


def make_row(result=None, *, breakdown=None, pcie=None, run_id: str = "",
             time_unix_s: float | None = None) -> dict:
    """One row: StepResult fields from `result`, breakdown fields from `breakdown` (default
    result.breakdown), PCIe deltas from `pcie` (a PcieBytes or None). Missing values are None;
    the engine's byte counts win over the breakdown's traced ones when both are present."""
    if breakdown is None:
        breakdown = getattr(result, "breakdown", None)
    row = dict.fromkeys(COLUMN_NAMES)
    row["run_id"] = run_id
    row["time_unix_s"] = time.time() if time_unix_s is None else time_unix_s
    for name in _BREAKDOWN:
        row[name] = _plain(getattr(breakdown, name, None))
    for name in ("step", "h2d_bytes", "d2h_bytes"):
        row[name] = _plain(getattr(breakdown, name, None))
    for name in _RESULT:
        value = getattr(result, name, None)
        if value is not None:
            row[name] = _plain(value)
    if pcie is not None:
        row["pcie_h2d_bytes"], row["pcie_d2h_bytes"] = pcie.rx_bytes, pcie.tx_bytes
    return row


def _plain(value):
    """Enums by value, NumPy scalars as Python numbers, the rest unchanged."""
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


# -- run metadata -----------------------------------------------------------------------------
def run_metadata(*, backend=None, plan=None, config=None) -> dict:
    """Facts about this run, stored once per run: run_id, start time, commit (or 'unknown'),
    package version (or 'dev'), Python/NumPy versions, backend and device name, NVIDIA driver,
    CuPy and CUDA runtime/driver versions (None where absent), plan hash and plan JSON, and
    `config` (any JSON-able mapping, e.g. the CLI arguments)."""
    meta = {"run_id": uuid.uuid4().hex[:12], "started_unix_s": time.time(),
            "commit": _git_commit(), "package_version": _package_version(),
            "python_version": platform.python_version(), "numpy_version": _version("numpy"),
            "backend": getattr(backend, "name", None),
            "device_name": getattr(backend, "device_name", None),
            "driver_version": _driver_version(), **_cuda_versions(backend),
            "plan_hash": getattr(plan, "hash", None),
            "plan": json.loads(plan.to_json()) if hasattr(plan, "to_json") else None,
            "config": _jsonable(config)}
    return meta


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _package_version() -> str:
    try:
        return importlib.metadata.version("dataflow")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml or no NVIDIA driver: unknown
        return None
    return v.decode() if isinstance(v, bytes) else str(v)


def _cuda_versions(backend) -> dict:
    out = {"cupy_version": None, "cuda_runtime_version": None, "cuda_driver_version": None}
    if getattr(backend, "name", None) != "cupy":
        return out
    try:
        import cupy

        out["cupy_version"] = cupy.__version__
        out["cuda_runtime_version"] = int(cupy.cuda.runtime.runtimeGetVersion())
        out["cuda_driver_version"] = int(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # noqa: BLE001 - versions are best effort
        pass
    return out


def _jsonable(obj):
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = to_dict(obj)
    return json.loads(json.dumps(obj, default=str, sort_keys=True))


# -- the log ----------------------------------------------------------------------------------
def _format_of(path: Path) -> str:
    ext = path.suffix.lower()
    if ext not in FORMATS:
        raise ConfigError(f"metrics file '{path}' has extension '{ext or '(none)'}'; use one of "
                          f"{', '.join(FORMATS)}")
    return ext


def _schema():
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, kind, _ in COLUMNS])


def meta_path(path: str | Path) -> Path:
    """Where a CSV log keeps its run metadata: '<path>.meta.json'."""
    return Path(str(path) + ".meta.json")


def lock_path(path: str | Path) -> Path:
    """The lock file writers of one log share: '<path>.lock'. It exists only while a writer holds
    it: each writer removes it before letting go (see _Locked), so no stray file stays beside
    the log."""
    return Path(str(path) + ".lock")


LOCK_TIMEOUT_S = 60.0
"""How long a writer waits for another one's read-rewrite (normally milliseconds)."""


class _Locked:
    """`with _Locked(path):` an exclusive advisory lock (flock) on lock_path(path), so runs that
    append to one log take turns: each re-reads the file under the lock and rewrites it whole
    (Parquet) or appends one row (CSV), and no run's rows are lost.

    The holder unlinks the lock file before unlocking, so none is left behind. A writer that
    opened the old file and locks it after that sees that the path no longer names what it
    locked, and starts again on the new file; so two writers never both hold "the" lock."""

    def __init__(self, path: Path):
        self.path = lock_path(path)

    def __enter__(self) -> "_Locked":
        import fcntl

        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    raise ConfigError(f"metrics log '{self.path}' stayed locked by another "
                                      f"writer for {LOCK_TIMEOUT_S:.0f} s; log to another "
                                      "file") from None
                time.sleep(0.01)
                continue
            if _same_file(fd, self.path):
                self._fd = fd
                return self
            os.close(fd)  # its holder removed it after we opened it: lock the new one

    def __exit__(self, *exc) -> None:
        import fcntl

        try:
            os.unlink(self.path)  # still holding it: no writer can take it between the two
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)


class MetricsLog:
    """`with MetricsLog("run.parquet", run_metadata(...)) as log: log.append(step_result)`.
    Appends to an existing file of the same columns, or of an earlier version's (it gains the
    newer columns, empty; any other columns are refused).
    Parquet files are rewritten whole (atomically) at every append, so the file is always
    readable even if the run dies; CSV rows are appended and flushed. Writers of one file take
    turns under a lock ('<path>.lock', present only while one writes), so concurrent runs keep
    all their rows. close(status)
    records how the run ended ('done', 'interrupted at step 3', ...) in its metadata."""

    def __init__(self, path: str | Path, metadata: dict | None = None):
        self.path = Path(path)
        self.format = _format_of(self.path)
        self.metadata = metadata if metadata is not None else run_metadata()
        self.run_id = self.metadata.setdefault("run_id", uuid.uuid4().hex[:12])
        self.rows: list[dict] = []
        self._f = None
        with _Locked(self.path):
            if self.format == ".csv":
                self._open_csv()
            else:
                self._write_parquet()

    def _check_columns(self, found) -> None:
        if tuple(found) != COLUMN_NAMES and tuple(found) not in OLDER_COLUMN_NAMES:
            raise ConfigError(f"'{self.path}' has columns {list(found)}, not this version's "
                              f"{list(COLUMN_NAMES)}; log to a new file")

    def _open_csv(self) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), [])
            self._check_columns(header)
            if tuple(header) != COLUMN_NAMES:  # an older version's log (we hold its lock)
                _upgrade_csv(self.path, len(header))
        self._write_csv_meta()
        self._f = open(self.path, "a", newline="")
        self._csv = csv.writer(self._f)
        if new:
            self._csv.writerow(COLUMN_NAMES)
            self._f.flush()

    def _merged_runs(self, runs: list[dict]) -> list[dict]:
        """The file's runs with this run's metadata in place (added at the end when new)."""
        out = [r for r in runs if r.get("run_id") != self.run_id]
        return out + [self.metadata]

    def _write_csv_meta(self) -> None:
        runs = read_run_metadata(self.path) if meta_path(self.path).exists() else []
        _atomic_write_text(meta_path(self.path), json.dumps({"runs": self._merged_runs(runs)},
                                                             indent=2, default=str))

    def append(self, result=None, *, breakdown=None, pcie=None) -> dict:
        """Write one step's row now; returns it."""
        row = make_row(result, breakdown=breakdown, pcie=pcie, run_id=self.run_id)
        self.rows.append(row)
        with _Locked(self.path):
            if self.format == ".csv":
                self._csv.writerow(["" if row[c] is None else _csv_text(row[c])
                                    for c in COLUMN_NAMES])
                self._f.flush()
            else:
                self._write_parquet()
        return row

    def _write_parquet(self) -> None:
        """Under the lock: the file as it is now (other runs' rows included), with this run's
        rows and metadata replaced by ours, written to a temp file and renamed over it."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        existing, runs = None, []
        if self.path.exists():
            existing = pq.read_table(self.path)
            self._check_columns(existing.column_names)
            runs = read_run_metadata(self.path)
            existing = existing.filter(pc.not_equal(existing["run_id"], self.run_id))
        schema = _schema().with_metadata(
            {"dataflow.runs": json.dumps(self._merged_runs(runs), default=str)})
        table = pa.Table.from_pylist(self.rows, schema=schema)
        if existing is not None:
            table = pa.concat_tables([_with_columns(existing).cast(schema), table])
        tmp = self.path.with_name(self.path.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.path)

    def close(self, status: str | None = None) -> None:
        """Close the log; `status` (if given) is stored in this run's metadata."""
        if status is not None and self.metadata.get("status") != status:
            self.metadata["status"] = status
            with _Locked(self.path):
                if self.format == ".csv":
                    self._write_csv_meta()
                else:
                    self._write_parquet()
        if self._f is not None and not self._f.closed:
            self._f.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _csv_text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_metrics(path: str | Path):
    """The log as a pyarrow.Table with exactly COLUMNS (names, order and types), either format."""
    path = Path(path)
    fmt = _format_of(path)
    schema = _schema()
    if fmt == ".parquet":
        import pyarrow.parquet as pq

        return _with_columns(pq.read_table(path)).cast(schema)
    import pyarrow.csv as pcsv

    opts = pcsv.ConvertOptions(column_types=schema, strings_can_be_null=True,
                               null_values=[""], include_columns=list(COLUMN_NAMES),
                               include_missing_columns=True)
    return pcsv.read_csv(path, convert_options=opts).select(list(COLUMN_NAMES)).cast(schema)


def _with_columns(table):
    """`table` (an older version's columns, a prefix of COLUMN_NAMES) with the missing columns
    appended, empty."""
    import pyarrow as pa

    for name, kind, _ in COLUMNS[table.num_columns:]:
        table = table.append_column(name, pa.nulls(table.num_rows, getattr(pa, kind)()))
    return table


def _upgrade_csv(path: Path, n_columns: int) -> None:
    """Rewrite a CSV log of an older version (its first n_columns columns) with this version's
    header and the newer columns empty: written beside it and renamed over it."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    missing = len(COLUMN_NAMES) - n_columns
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(COLUMN_NAMES)
        out.writerows(row + [""] * missing for row in rows[1:])
    os.replace(tmp, path)


def read_run_metadata(path: str | Path) -> list[dict]:
    """Every run's metadata stored with the log, oldest first."""
    path = Path(path)
    if _format_of(path) == ".csv":
        return json.loads(meta_path(path).read_text())["runs"]
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(b"dataflow.runs", b"[]"))
