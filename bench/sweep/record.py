"""The sweep table's schema: one CellRecord per cell, a frozen dataclass whose fields are the
table's columns, versioned by SCHEMA_VERSION. Derived ratios are properties, written beside the
fields when the table is saved and ignored when it is read back. Never runs or plans anything."""

from __future__ import annotations

import dataclasses
import enum
import typing

from dataflow.bench.sweep.grid import Cell
from dataflow.models.errors import ConfigError

SCHEMA_VERSION = 1
"""Bump when a column is renamed, removed or changes meaning; readers refuse other versions."""


class Status(enum.Enum):
    OK = "ok"
    """The demo finished every step."""
    PREDICTED = "predicted"
    """--predict-only: the planner's numbers only, no process started."""
    INFEASIBLE = "infeasible"
    """The planner refused the budgets (memplan.InfeasibleBudget); no process started."""
    DEVICE_OOM = "device_oom"
    HOST_OOM = "host_oom"
    TIMEOUT = "timeout"
    CRASH = "crash"
    """Any other failure; `error` holds the last line the process wrote to stderr."""

    @property
    def failed(self) -> bool:
        return self in (Status.DEVICE_OOM, Status.HOST_OOM, Status.TIMEOUT, Status.CRASH)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CellRecord:
    schema_version: int = SCHEMA_VERSION
    model: str
    seqlen: int
    host_gib: float
    """Host budget as asked, GiB (2^30 B)."""
    dev_gib: float
    host_budget_bytes: int
    device_budget_bytes: int
    status: str
    """A Status value."""
    error: str | None = None
    """Failures: the last line of the error (stderr, or the planner's refusal)."""
    backend: str
    """'numpy' or 'cupy' (the backend the demo ran, or would run, on)."""
    profile: str
    """Hardware profile the plan was made for."""
    device_name: str | None = None
    """The demo's device name for measured cells; the profile's name otherwise."""
    commit: str | None = None
    """Git commit of the code that ran ('+dirty' when the work tree differed from it)."""
    hostname: str | None = None
    run_id: str
    """Identifies one `dataflow-sweep run` invocation (a resumed sweep has a new one)."""
    started_at: str | None = None
    """UTC ISO time the cell started (or was planned)."""
    wall_s: float | None = None
    """Whole cell in its process: start-up, model initialisation, all steps, teardown."""
    steps: int
    steps_averaged: int | None = None
    """Steps the means below are over: all after the first (the only one if steps == 1)."""
    tok_per_s: float | None = None
    model_tflop_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    step_time_s: float | None = None
    steps_time_s: float | None = None
    """Sum of every step's time, the first included; wall_s minus this is start-up + init."""
    final_loss: float | None = None
    predicted_tok_per_s: float | None = None
    predicted_model_tflop_per_s: float | None = None
    predicted_mfu: float | None = None
    predicted_hfu: float | None = None
    predicted_step_time_s: float | None = None
    predicted_bottleneck: str | None = None
    plan_hash: str | None = None
    planner_version: str | None = None
    attention_bwd: str | None = None
    """The plan's attention backward, 'deterministic' or 'fast' (--fast-attention); tables
    written before this column read back as None, which was always 'deterministic'."""
    precision: str | None = None
    """The plan's precision, 'bf16' or 'fp8' (--precision; with a list, a grid axis, so it is
    part of the record's Cell); tables written before this column read back as None, which was
    always 'bf16'."""
    lora: str | None = None
    """The plan's LoRA adapters as the flags that give them ('--lora-rank 16 --lora-alpha 16
    --lora-targets q,k,v,o,gate,up,down'; docs/lora.md), None without (tables written before
    this column read back as None, which was always none)."""
    chunk_tokens: int | None = None
    chunks_per_round: int | None = None
    rounds_per_step: int | None = None
    seqs_per_step: int | None = None
    layers_weights_on_device: int | None = None
    layers_grads_on_device: int | None = None
    optimizer_where: str | None = None
    """Where AdamW runs, over the transformer layers: 'device', 'host', 'streamed' or a '+' mix."""
    grad_accum: str | None = None
    weight_slots: int | None = None
    act_slots: int | None = None
    acts_home: int | None = None
    """Saved activations (per layer and chunk of a round) that live in host memory."""
    acts_inp_only: int | None = None
    acts_inp_attn: int | None = None
    acts_full: int | None = None
    planned_device_bytes: int | None = None
    planned_host_bytes: int | None = None
    min_device_bytes: int | None = None
    """Infeasible cells: the smallest device budget that works for this model and seqlen."""
    min_host_bytes: int | None = None
    peak_rss_bytes: int | None = None
    """Largest resident set of the cell's process tree, sampled every 0.2 s by the parent."""
    peak_device_used_bytes: int | None = None
    """Largest device memory the cell's processes used (NVML, sampled every 0.2 s); None without
    a GPU."""
    device_peak_method: str | None = None
    """'process' (NVML per-process accounting) or 'device-delta' (device-wide used minus what
    was used before the cell started, where NVML cannot see the process, e.g. in containers)."""
    context_bytes: int | None = None
    """The CUDA context's share of the peak, from the demo's memory report."""
    peak_device_minus_context_bytes: int | None = None
    busy_samples: int | None = None
    """NVML samples with the GPU busy; the three columns below are their means (sweep.monitor)."""
    sm_clock_mhz_mean: float | None = None
    power_w_mean: float | None = None
    power_capped_frac: float | None = None
    """Share of busy samples the power cap held the clock down: cells compare at like clocks."""
    exit_code: int | None = None
    log: str | None = None
    """The cell's stderr log, relative to the sweep directory."""

    def __post_init__(self):
        if self.schema_version != SCHEMA_VERSION:
            raise ConfigError(f"sweep record schema_version {self.schema_version} is not "
                              f"supported; this version reads {SCHEMA_VERSION} (rerun the sweep "
                              "into a new directory, or with --redo)")
        known = [s.value for s in Status]
        if self.status not in known:
            raise ConfigError(f"sweep record status {self.status!r} is unknown; known: {known}")

    @property
    def cell(self) -> Cell:
        return Cell(model=self.model, seqlen=self.seqlen, host_gib=self.host_gib,
                    dev_gib=self.dev_gib, precision=self.precision or "bf16")

    @property
    def state(self) -> Status:
        return Status(self.status)

    @property
    def predicted_over_measured(self) -> float | None:
        return _ratio(self.predicted_tok_per_s, self.tok_per_s)

    @property
    def device_peak_over_budget(self) -> float | None:
        return _ratio(self.peak_device_minus_context_bytes, self.device_budget_bytes)

    @property
    def host_peak_over_budget(self) -> float | None:
        return _ratio(self.peak_rss_bytes, self.host_budget_bytes)

    def to_row(self) -> dict:
        """Columns in schema order, then the derived ratios."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        row.update({name: getattr(self, name) for name in DERIVED})
        return row

    @classmethod
    def from_row(cls, row: dict) -> "CellRecord":
        """Inverse of to_row; refuses unknown columns (naming them) and other schema versions."""
        row = {k: v for k, v in row.items() if k not in DERIVED}
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise ConfigError(f"sweep table: unknown columns {unknown}; schema "
                              f"{SCHEMA_VERSION} has {list(COLUMNS)}")
        if row.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ConfigError(f"sweep table schema_version {row['schema_version']} is not "
                              f"supported; this version reads {SCHEMA_VERSION}")
        return cls(**row)


def _ratio(num, den) -> float | None:
    return None if num is None or not den else num / den


DERIVED = ("predicted_over_measured", "device_peak_over_budget", "host_peak_over_budget")
COLUMNS = tuple(f.name for f in dataclasses.fields(CellRecord))


def column_types() -> dict[str, type]:
    """Column -> int, float or str (the non-None member of each field's type); derived: float."""
    hints = typing.get_type_hints(CellRecord)
    out = {}
    for name in COLUMNS:
        args = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
        out[name] = args[0]
    out.update({name: float for name in DERIVED})
    return out
