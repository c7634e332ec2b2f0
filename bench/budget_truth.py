"""Budget truth (issue 13): runs the demo for a list of cells, each in a fresh process, samples the
process tree's resident memory (psutil) and the device's used memory (NVML, when pynvml and a GPU
exist) every 0.2 s, and writes one JSON record per cell: budgets, the plan's totals and predicted
tok/s, measured peaks, overshoot past each budget, tok/s, init time and status. The parent only
plans (pure Python) and samples: it never creates a CUDA context, so it adds nothing to what it
measures, and it never trains in its own process.

    python -m dataflow.bench.budget_truth --out bench/records/budget-truth-h100            # issue 13's cells
    python -m dataflow.bench.budget_truth --out runs/bt --backend numpy --steps 2 tiny:256:2:0.25
    python -m dataflow.bench.budget_truth --out runs/bt --fast-attention --steps 3 8b:8192:80:24
    python -m dataflow.bench.budget_truth --out runs/bt --precision fp8 --rounds 4 8b:65536:100:24
    python -m dataflow.bench.budget_truth --out runs/bt --lora-rank 16 8b:8192:24:24

A peak is the largest 0.2 s sample, so a spike shorter than that can be missed; the device
overshoot subtracts the CUDA context the demo itself reports, so a cell that dies before its
report (an OutOfMemoryError) records `device_above_budget_bytes` only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.classify import classify
from dataflow.cli.args import add_lora_flags, lora_of
from dataflow.bench.sweep.grid import Cell, format_number
from dataflow.bench.sweep.monitor import INTERVAL_S, PeakSampler, open_nvml
from dataflow.bench.sweep.planning import now_iso, resolve_backend, resolve_profile
from dataflow.bench.sweep.record import Status
from dataflow.bench.sweep.runner import measured_fields
from dataflow.bench.sweep.sweep import git_commit
from dataflow.memplan import InfeasibleBudget, make_plan
from dataflow.precision import PRECISIONS
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.plan.plan import Budget
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import model_config
from dataflow.models.serial import to_json

log = logging.getLogger("dataflow.budget_truth")
REPO_ROOT = Path(__file__).resolve().parents[1]
ISSUE_13_CELLS = ("8b:8192:80:24", "8b:65536:120:24", "8b:65536:96:30", "8b:131072:120:24",
                  "1b:524288:120:24", "1b:1048576:120:24")
"""MODEL:SEQLEN:HOST_GB:DEV_GB of every cell issue 13's 'done' list names."""
_INIT_LINE = re.compile(r"initialised \S+ in ([0-9.]+) s")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BudgetRecord:
    """One cell's measurement. Bytes are bytes; GiB (2^30 B) only in the *_gib budget echoes."""

    model: str
    seqlen: int
    host_gib: float
    dev_gib: float
    host_budget_bytes: int
    device_budget_bytes: int
    steps: int
    backend: str
    """'numpy' or 'cupy': what the demo was told to run on."""
    profile: str
    """The hardware profile the plan (and its prediction) was made for."""
    attention_bwd: str = "deterministic"
    """The plan's attention backward: 'fast' with --fast-attention (cuDNN's atomic dQ, as
    dataflow-demo --fast-attention), else 'deterministic'."""
    rounds_per_step: int | None = None
    """--rounds: the rounds per step every cell was planned at; None: the planner's own."""
    lora: str | None = None
    """--lora-*: the LoRA adapters every cell was planned (and so trained) with (docs/lora.md),
    as Lora's own spelling; None: full fine-tuning."""
    precision: str = "bf16"
    """--precision: the block projections' GEMM precision every cell was planned (and so run) in
    (docs/fp8.md)."""
    status: str
    """A dataflow.bench.sweep.record.Status value: ok, infeasible (the planner refused: no process),
    device_oom, host_oom, timeout or crash."""
    error: str | None = None
    """The last line the demo wrote to stderr, or the planner's refusal."""
    exit_code: int | None = None
    plan_hash: str | None = None
    planned_device_bytes: int | None = None
    """Sum of the plan's device regions (the arena is the whole budget; this is what it uses)."""
    planned_host_bytes: int | None = None
    predicted_tok_per_s: float | None = None
    """The planner's prediction for the compiled schedule (dataflow.memplan.search.predict.predict_schedule)."""
    peak_device_used_bytes: int | None = None
    """Largest NVML sample: per-process used memory, or device-wide used minus the level before
    the cell started (device_method says which); includes the CUDA context. None without NVML."""
    device_method: str | None = None
    device_idle_bytes: int | None = None
    context_bytes: int | None = None
    """The CUDA context as the demo's backend measured it, minus the idle level; None when the
    demo did not get to report it."""
    device_above_budget_bytes: int | None = None
    """peak_device_used_bytes - device budget (the context not subtracted)."""
    device_overshoot_bytes: int | None = None
    """peak_device_used_bytes - context_bytes - device budget: > 0 means device bytes outside
    the plan's arena."""
    libraries_and_pool_bytes: int | None = None
    """The demo's own count, after its last step, of device bytes beside the context and the
    arena (cuBLAS / cuDNN workspaces, kernel scratch, CuPy's pool); None off the GPU."""
    peak_rss_bytes: int | None = None
    """Largest sample of the demo's process-tree resident memory."""
    host_overshoot_bytes: int | None = None
    """peak_rss_bytes - host budget: what the process holds beyond its host budget. On the
    NumPy backend the device arena is host memory too, so its budget is subtracted as well."""
    tok_per_s: float | None = None
    """Mean over the steps after the first (the first warms up), as the sweep averages."""
    steps_averaged: int | None = None
    step_time_s: float | None = None
    init_s: float | None = None
    """The demo's own 'initialised ... in X s' (arenas, state, weights)."""
    wall_s: float | None = None
    """The whole demo process, start to exit."""
    busy_samples: int | None = None
    """NVML samples with the GPU busy; the means below are over them (dataflow.bench.sweep.monitor)."""
    sm_clock_mhz_mean: float | None = None
    power_w_mean: float | None = None
    power_capped_frac: float | None = None
    """Share of busy samples held down by the power cap: tok/s of two runs compare only at
    similar clocks."""
    device_name: str | None = None
    commit: str | None = None
    hostname: str | None = None
    started_at: str | None = None
    log: str | None = None
    """The demo's stderr, relative to the output directory."""

    @property
    def cell(self) -> Cell:
        return Cell(model=self.model, seqlen=self.seqlen, host_gib=self.host_gib,
                    dev_gib=self.dev_gib)


def parse_cell(text: str) -> Cell:
    """'MODEL:SEQLEN:HOST_GB:DEV_GB', e.g. '8b:65536:120:24' (GB means GiB)."""
    parts = text.rsplit(":", 3)
    if len(parts) != 4 or not parts[0]:
        raise ConfigError(f"cell {text!r} is not MODEL:SEQLEN:HOST_GB:DEV_GB; write e.g. "
                          "'8b:65536:120:24'")
    model, seqlen, host, dev = parts
    try:
        seq, host_gib, dev_gib = int(seqlen), float(host), float(dev)
    except ValueError:
        raise ConfigError(f"cell {text!r}: seqlen must be a whole number and the budgets "
                          "numbers; write e.g. '8b:65536:120:24'") from None
    if seq <= 0 or not (0 < host_gib < float("inf")) or not (0 < dev_gib < float("inf")):
        raise ConfigError(f"cell {text!r}: seqlen and budgets must be positive and finite")
    return Cell(model=model, seqlen=seq, host_gib=host_gib, dev_gib=dev_gib)


def _demo_command(cell: Cell, steps: int, backend: str, plan_path: Path) -> list[str]:
    return [sys.executable, "-m", "dataflow.cli.demo", format_number(cell.host_gib),
            format_number(cell.dev_gib), str(cell.seqlen), cell.model, "--steps", str(steps),
            "--backend", backend, "--plan", str(plan_path), "--json"]


def _run_demo(cmd: list[str], out_path: Path, err_path: Path, nvml, timeout_s: float):
    """(exit code, timed out, peaks, wall seconds) of one demo process, sampled as it runs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")]))}
    t0, timed_out = time.monotonic(), False
    with open(out_path, "w") as out, open(err_path, "w") as err, PeakSampler(nvml) as sampler:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
        sampler.watch(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C: take the cell's processes down with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    return rc, timed_out, sampler.peaks(), time.monotonic() - t0


def _minus(a: int | None, *others: int | None) -> int | None:
    if a is None or any(o is None for o in others):
        return None
    return a - sum(others)


def run_cell(cell: Cell, *, out: Path, steps: int, backend: str, profile, timeout_s: float,
             commit: str | None = None, attention_bwd: str = "deterministic",
             rounds: int | None = None, precision: str = "bf16", lora=None) -> BudgetRecord:
    """Plan the cell, run the demo on that plan in a fresh process, write OUT/<slug>.json.
    The plan file carries `attention_bwd`, `precision` and, when given, `rounds` per step to
    the demo."""
    budget = Budget.from_gib(cell.host_gib, cell.dev_gib)
    base = {"model": cell.model, "seqlen": cell.seqlen, "host_gib": cell.host_gib,
            "dev_gib": cell.dev_gib, "host_budget_bytes": budget.host_bytes,
            "device_budget_bytes": budget.device_bytes, "steps": steps, "backend": backend,
            "profile": profile.name, "attention_bwd": attention_bwd, "commit": commit,
            "rounds_per_step": rounds, "precision": precision,
            "lora": None if lora is None else str(lora),
            "hostname": socket.gethostname(), "started_at": now_iso()}
    slug = cell.slug
    try:
        plan = make_plan(model_config(cell.model), cell.seqlen, budget, profile,
                         attention_bwd=attention_bwd, precision=precision, lora=lora,
                         **({"rounds_per_step": rounds} if rounds else {}))
    except InfeasibleBudget as exc:
        record = BudgetRecord(status=Status.INFEASIBLE.value,
                              error=str(exc).strip().splitlines()[-1], **base)
        return _save(record, out / f"{slug}.json")
    plan_path, err_path = out / f"{slug}.plan.json", out / f"{slug}.log"
    plan_path.write_text(plan.to_json())
    nvml = open_nvml() if backend == "cupy" else None  # the idle level, read before the start
    try:
        rc, timed_out, peaks, wall_s = _run_demo(
            _demo_command(cell, steps, backend, plan_path), out / f"{slug}.demo.json", err_path,
            nvml, timeout_s)
    finally:
        if nvml is not None:
            nvml.close()
    stderr = err_path.read_text(errors="replace")
    status, error = classify(rc, stderr, timed_out=timed_out, timeout_s=timeout_s)
    fields: dict = {}
    context = None
    if status is Status.OK:
        try:
            doc = json.loads((out / f"{slug}.demo.json").read_text())
            fields = measured_fields(doc)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            status, error = Status.CRASH, f"the demo exited 0 but its --json was unreadable: {exc}"
        else:
            fields = {k: fields[k] for k in ("device_name", "tok_per_s", "steps_averaged",
                                             "step_time_s")}
            if doc.get("status", "done") != "done":
                status, error = Status.CRASH, f"the demo ended with status {doc['status']!r}"
            memory = doc.get("memory") or {}
            fields["libraries_and_pool_bytes"] = memory.get("libraries_and_pool_bytes")
            baseline = memory.get("context_baseline_bytes")
            if baseline is not None and peaks.device_idle_bytes is not None:
                # the backend's baseline is device-wide; the context is what rose above idle
                context = int(baseline) - peaks.device_idle_bytes
    init = _INIT_LINE.findall(stderr)
    dev_peak = peaks.device_used_bytes
    pred = predict_schedule(plan, plan.profile)
    record = BudgetRecord(
        status=status.value, error=error, exit_code=rc, plan_hash=plan.hash,
        planned_device_bytes=plan.memory.device_bytes, planned_host_bytes=plan.memory.host_bytes,
        predicted_tok_per_s=pred.tok_per_s, peak_device_used_bytes=dev_peak,
        device_method=peaks.device_method, device_idle_bytes=peaks.device_idle_bytes,
        context_bytes=context,
        device_above_budget_bytes=_minus(dev_peak, budget.device_bytes),
        device_overshoot_bytes=_minus(dev_peak, context, budget.device_bytes),
        peak_rss_bytes=peaks.rss_bytes, busy_samples=peaks.busy_samples,
        sm_clock_mhz_mean=peaks.sm_clock_mhz_mean, power_w_mean=peaks.power_w_mean,
        power_capped_frac=peaks.power_capped_frac,
        host_overshoot_bytes=_minus(peaks.rss_bytes, budget.host_bytes,
                                    budget.device_bytes if backend == "numpy" else 0),
        init_s=float(init[-1]) if init else None, wall_s=wall_s,
        log=err_path.name, **fields, **base)
    return _save(record, out / f"{slug}.json")


def _save(record: BudgetRecord, path: Path) -> BudgetRecord:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(to_json(record) + "\n")
    tmp.replace(path)  # a reader never sees half a record
    return record


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:+.2f} GiB"


def summary_line(r: BudgetRecord) -> str:
    """One line per cell for the log: status, overshoots, tok/s against the prediction."""
    if r.status == Status.INFEASIBLE.value:
        return f"{r.cell.label}: infeasible (no process started): {r.error}"
    tok = "n/a" if r.tok_per_s is None else f"{r.tok_per_s:,.0f}"
    pred = "n/a" if r.predicted_tok_per_s is None else f"{r.predicted_tok_per_s:,.0f}"
    init = "n/a" if r.init_s is None else f"{r.init_s:.1f} s"
    clock = "" if r.sm_clock_mhz_mean is None else (
        f"; busy GPU at {r.sm_clock_mhz_mean:,.0f} MHz, {r.power_w_mean:.0f} W, power-capped "
        f"{r.power_capped_frac:.0%} of the time")
    return (f"{r.cell.label}: {r.status}; device overshoot {_gib(r.device_overshoot_bytes)} "
            f"(above budget {_gib(r.device_above_budget_bytes)}), host overshoot "
            f"{_gib(r.host_overshoot_bytes)}; {tok} tok/s (predicted {pred}); init {init}"
            + clock + (f"; {r.error}" if r.error else ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dataflow.bench.budget_truth",
        description="Run the demo for each cell in a fresh process, sample process-tree RSS "
                    f"and NVML device memory every {INTERVAL_S:g} s, and write OUT/<cell>.json "
                    "per cell (budgets, plan totals, peaks, overshoot, tok/s, init time, "
                    "status). GB means GiB (2^30 bytes).")
    p.add_argument("cells", nargs="*", metavar="MODEL:SEQLEN:HOST_GB:DEV_GB",
                   help="cells to run, e.g. 8b:65536:120:24 (default: issue 13's cells "
                        f"{' '.join(ISSUE_13_CELLS)})")
    p.add_argument("--out", required=True, help="directory for the records and demo logs")
    p.add_argument("--steps", type=int, default=2,
                   help="training steps per cell (tok/s averages those after the first; "
                        "default 2)")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="plan every cell at N rounds per step (default: the planner's; fewer "
                        "rounds make an 8b-sized step at 8k take seconds instead of a minute; "
                        "the prediction is for the rounds that run)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds per cell before it is killed and recorded as a timeout")
    p.add_argument("--gpu", metavar="NAME", help="plan for this built-in profile instead of "
                                                  "the local device's")
    p.add_argument("--fast-attention", action="store_true",
                   help="plan every cell with cuDNN's atomic-dQ attention backward, as "
                        "dataflow-demo --fast-attention does (faster; dQ may differ in the last "
                        "bits between runs; split sequences use it either way)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="plan (and so run) every cell with the block projections in this "
                        "precision (docs/fp8.md; fp8 needs an sm_89+ GPU; default bf16)")
    add_lora_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        cells = [parse_cell(c) for c in (args.cells or ISSUE_13_CELLS)]
        if args.rounds is not None and args.rounds < 1:
            raise ConfigError(f"--rounds {args.rounds} must be at least 1; try --rounds 8")
        if args.steps < 1 or not (0 < args.timeout < float("inf")):
            raise ConfigError(f"--steps {args.steps} and --timeout {args.timeout:g} must be "
                              "positive; try --steps 2 --timeout 600")
        for cell in cells:
            model_config(cell.model)  # an unknown model is refused before any cell runs
        lora = lora_of(args)
        backend = resolve_backend(args.backend)
        profile = resolve_profile(backend, gpu=args.gpu)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"budget_truth: {exc}", file=sys.stderr)
        return 2
    commit = git_commit(REPO_ROOT)
    for cell in cells:
        log.info("%s: running on %s (profile %s)", cell.label, backend, profile.name)
        record = run_cell(cell, out=out, steps=args.steps, backend=backend, profile=profile,
                          timeout_s=args.timeout, commit=commit,
                          attention_bwd="fast" if args.fast_attention else "deterministic",
                          rounds=args.rounds, precision=args.precision, lora=lora)
        log.info("%s", summary_line(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
