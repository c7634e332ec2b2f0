"""Runs a sweep: skips the cells already finished in the sweep directory (unless redo), plans the
rest in this process (recording refused and, with predict_only, all cells at once), hands the
runnable cells to an executor and rewrites the table after every cell, with one progress line per
cell. Never trains in its own process and never decides placement."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
import uuid
from pathlib import Path

from dataflow.bench.sweep.executors import Executor, LocalExecutor
from dataflow.bench.sweep.grid import Cell
from dataflow.bench.sweep.planning import (
    gpu_names,
    lora_flags,
    plan_cell,
    resolve_backend,
    resolve_profile,
)
from dataflow.bench.sweep.record import CellRecord, Status
from dataflow.bench.sweep.runner import REPO_ROOT, CellJob
from dataflow.bench.sweep.table import CSV, PARQUET, SweepStore
from dataflow.memplan.plan.lora import Lora
from dataflow.models.errors import ConfigError
from dataflow.precision import PRECISIONS

log = logging.getLogger("dataflow.sweep")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SweepConfig:
    cells: tuple[Cell, ...]
    out: str
    """The sweep directory: records, logs, plans and the table."""
    steps: int = 3
    backend: str = "auto"
    """'auto', 'numpy' or 'cupy', passed to every cell's demo once resolved."""
    timeout_s: float = 1800.0
    """Per cell, start-up and model initialisation included."""
    redo: bool = False
    """Run cells that already have a record."""
    predict_only: bool = False
    gpu: str | None = None
    """Plan for this built-in hardware profile instead of the local device's."""
    profile_file: str | None = None
    attention_bwd: str = "deterministic"
    """'fast' (--fast-attention): plan every cell with cuDNN's atomic-dQ attention backward."""
    precisions: tuple[str, ...] = ("bf16",)
    """--precision: the precisions the cells were expanded over ('fp8': the linear layers in
    FP8, docs/fp8.md). Each cell plans in its own; one value is a one-precision sweep, several
    a precision grid, whose directory names every record by its precision (SweepStore)."""
    lora: Lora | None = None
    """--lora-rank / --lora-alpha / --lora-targets: plan (and so train) every cell with these
    LoRA adapters on a frozen base (docs/lora.md)."""


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """Short HEAD commit of the code that runs the cells, '+dirty' when tracked files differ.
    A tree exported by `git archive` (no .git of its own, perhaps inside another checkout, as
    on the GPU machine) gives the commit it was archived from, never the enclosing repo's."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
        if top.returncode or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return _archived_commit(root)
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _archived_commit(root: Path) -> str | None:
    """The commit `git archive` wrote into bench/ARCHIVE_COMMIT (.gitattributes: export-subst);
    None in a checkout, where it holds the unexpanded placeholder."""
    try:
        text = (Path(root) / "bench" / "ARCHIVE_COMMIT").read_text().strip()
    except OSError:
        return None
    return None if not text or "$" in text else text + "+archive"


def is_finished(record: CellRecord | None, predict_only: bool) -> bool:
    """A cell with any record is finished, failures included (--redo runs it again), except that
    a planner-only record does not finish a measuring sweep."""
    return record is not None and (predict_only or record.state is not Status.PREDICTED)


class _Progress:
    """One line per cell: 'cell k of n', the outcome and an ETA from the cells run so far."""

    def __init__(self, total: int, to_run: int):
        self.total, self.to_run, self.done, self.ran, self.run_s = total, to_run, 0, 0, 0.0

    def cell(self, r: CellRecord) -> None:
        self.done += 1
        if r.wall_s is not None:
            self.ran += 1
            self.run_s += r.wall_s
        left = self.to_run - self.ran
        eta = f"; eta {_duration(self.run_s / self.ran * left)}" if self.ran and left else ""
        log.info("[%d/%d] %s: %s%s", self.done, self.total, r.cell.label, outcome(r), eta)


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _fmt(value, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


def outcome(r: CellRecord) -> str:
    """The record in a few words, for progress lines."""
    if r.state is Status.INFEASIBLE:
        return (f"infeasible (smallest budgets that work together: host "
                f"{_size(r.min_host_bytes)}, dev {_size(r.min_device_bytes)})")
    if r.state is Status.PREDICTED:
        return (f"predicted {r.predicted_tok_per_s:,.0f} tok/s, MFU {r.predicted_mfu:.1%} "
                f"({r.predicted_bottleneck}-bound)")
    if r.state is Status.OK:
        mem = f", peak RSS {r.peak_rss_bytes / GIB:.2f} GiB" if r.peak_rss_bytes else ""
        if r.peak_device_minus_context_bytes is not None:
            mem += f", device {r.peak_device_minus_context_bytes / GIB:.2f} GiB"
        return (f"ok {_fmt(r.tok_per_s, ',.0f')} tok/s (predicted "
                f"{_fmt(r.predicted_tok_per_s, ',.0f')}), MFU {_fmt(r.mfu, '.1%')}{mem}, "
                f"{_fmt(r.wall_s, '.1f')} s")
    return f"{r.status}: {r.error}" + (f" ({r.wall_s:.1f} s)" if r.wall_s is not None else "")


def run_sweep(config: SweepConfig, executor: Executor | None = None) -> list[CellRecord]:
    """Run (or predict) every unfinished cell of `config`; returns the records of its cells in
    grid order. Each record is saved the moment its cell finishes."""
    t0 = time.monotonic()
    executor = executor or LocalExecutor()
    store = SweepStore(config.out, by_precision=len(config.precisions) > 1)
    records = store.load()
    _refuse_mixed_settings(config, records.values(), store.named_by_precision())
    backend = resolve_backend(config.backend)
    if backend == "cupy" and not config.predict_only and not gpu_names():
        raise ConfigError("--backend cupy but NVML sees no GPU here; use --backend numpy, or "
                          "--predict-only to see the planner's numbers")
    # a prediction with no backend named is for the GPU a user would rent, even on a laptop
    planned_for = "cupy" if config.predict_only and config.backend == "auto" else backend
    profile = resolve_profile(planned_for, gpu=config.gpu, profile_file=config.profile_file,
                              predict_only=config.predict_only)
    todo = [c for c in config.cells
            if config.redo or not is_finished(records.get(c), config.predict_only)]
    skipped = len(config.cells) - len(todo)
    log.info("sweep %s: %d cell(s), %d finished already%s; backend %s, planned for %s",
             config.out, len(config.cells), skipped, " (redo)" if config.redo else "",
             "none (predict only)" if config.predict_only else backend, profile.name)
    common = dict(backend=backend, steps=config.steps, run_id=uuid.uuid4().hex[:12],
                  commit=git_commit())
    jobs, progress = [], _Progress(len(todo), 0)
    for cell in todo:
        plan, record = plan_cell(cell, profile, attention_bwd=config.attention_bwd,
                                 precision=cell.precision, lora=config.lora, **common)
        if plan is None or config.predict_only:
            _keep(store, records, record)
            progress.cell(record)
            continue
        plan_path = store.plans_dir / f"{plan.hash}.json"
        if not plan_path.exists():
            store.plans_dir.mkdir(parents=True, exist_ok=True)
            plan_path.write_text(plan.to_json())
        jobs.append(CellJob(planned=record, plan_path=str(plan_path.resolve()),
                            out=str(store.root.resolve()), timeout_s=config.timeout_s,
                            by_precision=store.by_precision))
    progress.to_run = len(jobs)
    if jobs:
        log.info("running %d cell(s) through the %s executor, %d step(s) each, timeout %s",
                 len(jobs), executor.name, config.steps, _duration(config.timeout_s))
    for record in executor.run(jobs):
        _keep(store, records, record)
        progress.cell(record)
    records.update((r.cell, r) for r in store.rebuild_table())  # other sweeps' cells too
    mine = [records[c] for c in config.cells if c in records]
    counts = {}
    for r in mine:
        counts[r.status] = counts.get(r.status, 0) + 1
    log.info("done in %s: %s; table %s and %s", _duration(time.monotonic() - t0),
             ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
             store.root / PARQUET, store.root / CSV)
    return mine


def _refuse_mixed_settings(config: SweepConfig, records, by_precision: bool | None) -> None:
    """One table, one attention backward, one set of precisions and one LoRA: cells are keyed by
    model, seqlen, budgets and precision, so a resumed sweep with another setting would skip
    cells measured with the first one. `by_precision`: whether the records on disk are named
    as a precision grid's (None: no records)."""
    mine = lora_flags(config.lora)
    other = sorted({r.lora or "" for r in records} - {mine or ""})
    if other:
        held = f"with LoRA ({other[0]})" if other[0] else "without LoRA"
        how = f"run with {other[0]}" if other[0] else "run without --lora-rank"
        raise ConfigError(f"{config.out} holds cells planned {held}; {how} to resume it, or "
                          "give another --out")
    _refuse_other_precisions(config, {r.precision or "bf16" for r in records}, by_precision)
    other = sorted({r.attention_bwd or "deterministic" for r in records} -
                   {config.attention_bwd})
    if other:
        flag = "without --fast-attention" if config.attention_bwd == "fast" else \
            "with --fast-attention"
        raise ConfigError(f"{config.out} holds cells planned with the {other[0]} attention "
                          f"backward; run {flag} to resume it, or give another --out")


def _refuse_other_precisions(config: SweepConfig, held: set[str],
                             by_precision: bool | None) -> None:
    """A one-precision directory resumes with that precision alone (as before precision was a
    grid axis); a precision grid's directory resumes with a list holding every precision it
    has cells in."""
    asked = config.precisions
    if len(asked) == 1:
        if by_precision:
            grid = [p for p in PRECISIONS if p in held or p in asked]
            grid = grid if len(grid) > 1 else list(PRECISIONS)
            raise ConfigError(f"{config.out} holds a precision grid (cells in "
                              f"{', '.join(p for p in PRECISIONS if p in held)} so far, named "
                              f"by precision); run with --precision {','.join(grid)} to resume "
                              f"it, or give another --out for --precision {asked[0]}")
        other = sorted(held - set(asked))
        if other:
            raise ConfigError(f"{config.out} holds cells planned in {other[0]}; run with "
                              f"--precision {other[0]} to resume it, or give another --out")
        return
    listed = ",".join(asked)
    if by_precision is False:
        one = min(held)  # records on disk, so at least one precision
        raise ConfigError(f"{config.out} holds a one-precision sweep (cells in {one}); run with "
                          f"--precision {one} to resume it, or give another --out for "
                          f"--precision {listed}")
    extra = [p for p in PRECISIONS if p in held and p not in asked]
    if extra:
        raise ConfigError(f"{config.out} holds cells planned in {extra[0]}, which --precision "
                          f"{listed} leaves out; run with --precision {listed},"
                          f"{','.join(extra)} to resume it, or give another --out")


def _keep(store: SweepStore, records: dict, record: CellRecord) -> None:
    """Save the cell's record and rewrite the table, so a kill loses nothing finished (the table
    is rebuilt from the directory's records, so another sweep writing there keeps its rows)."""
    store.save(record)
    records[record.cell] = record
    store.rebuild_table()
