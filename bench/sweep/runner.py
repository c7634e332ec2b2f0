"""Runs one sweep cell: the demo in a child process (`python -m dataflow.cli.demo ... --json --plan
FILE`) with a timeout, sampled by the parent for peak RSS and device memory, then classified and
saved at once. The child runs the exact plan the parent predicted, so the plan hash and the
predicted tok/s in the table belong to the run measured. Never plans and never trains in its own
process."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.classify import classify
from dataflow.bench.sweep.grid import format_number
from dataflow.bench.sweep.monitor import PeakSampler, open_nvml
from dataflow.bench.sweep.planning import now_iso
from dataflow.bench.sweep.record import CellRecord, Status
from dataflow.bench.sweep.table import SweepStore

log = logging.getLogger("dataflow.sweep")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CellJob:
    """Everything a worker (this machine or a Slurm node) needs to run one cell."""

    planned: CellRecord
    """The PREDICTED record; the run fills in the measured fields."""
    plan_path: str
    """The plan JSON the demo runs (--plan)."""
    out: str
    """The sweep directory (shared with the workers)."""
    timeout_s: float
    python: str = sys.executable
    by_precision: bool = False
    """The sweep is a precision grid: record and log names end in the precision (SweepStore)."""


def demo_command(job: CellJob) -> list[str]:
    r = job.planned
    return [job.python, "-m", "dataflow.cli.demo", format_number(r.host_gib), format_number(r.dev_gib),
            str(r.seqlen), r.model, "--steps", str(r.steps), "--backend", r.backend,
            "--plan", job.plan_path, "--json"]


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the sweep dies (even by SIGKILL),
    so a killed sweep leaves no orphan training on the device. A no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _mean(values):
    return sum(values) / len(values) if values else None


def measured_fields(doc: dict) -> dict:
    """The demo's --json document as record fields: means over the steps after the first."""
    steps = doc["steps"]
    steady = steps[1:] or steps
    mean = {k: _mean([s[k] for s in steady]) for k in
            ("tok_per_s", "model_tflop_per_s", "mfu", "hfu", "step_time_s")}
    return dict(device_name=doc.get("device"), steps_averaged=len(steady),
                steps_time_s=sum(s["step_time_s"] for s in steps), final_loss=steps[-1]["loss"],
                **mean)


def run_cell(job: CellJob) -> CellRecord:
    """Run the cell, save its record under the sweep directory and return it."""
    store = SweepStore(job.out, by_precision=job.by_precision)
    slug = store.name(job.planned.cell)
    store.logs_dir.mkdir(parents=True, exist_ok=True)
    err_path, out_path = store.logs_dir / f"{slug}.log", store.logs_dir / f"{slug}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")]))}
    nvml = open_nvml() if job.planned.backend == "cupy" else None  # idle level read before start
    started, t0 = now_iso(), time.monotonic()
    timed_out = False
    with open(err_path, "w") as err, open(out_path, "w") as out, PeakSampler(nvml) as sampler:
        proc = subprocess.Popen(demo_command(job), stdout=out, stderr=err, cwd=REPO_ROOT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        sampler.watch(proc.pid)
        try:
            rc = proc.wait(timeout=job.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:  # Ctrl-C or a signal: take the cell's processes down with us
            _kill_group(proc)
            raise
    wall_s = time.monotonic() - t0
    peaks = sampler.peaks()
    if nvml is not None:
        nvml.close()
    status, error = classify(rc, err_path.read_text(errors="replace"), timed_out=timed_out,
                             timeout_s=job.timeout_s)
    fields = {}
    if status is Status.OK:
        try:
            doc = json.loads(out_path.read_text())
            fields = measured_fields(doc)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            status, error = Status.CRASH, f"the demo exited 0 but its --json was unreadable: {exc}"
        else:
            if doc.get("status", "done") != "done":  # newer demos say how the loop ended
                status, error = Status.CRASH, f"the demo ended with status {doc['status']!r}"
            if doc.get("plan_hash") != job.planned.plan_hash:
                log.warning("%s: the demo ran plan %s, not the planned %s", job.planned.cell.label,
                            doc.get("plan_hash"), job.planned.plan_hash)
                fields["plan_hash"] = doc.get("plan_hash")
            context = (doc.get("memory") or {}).get("context_baseline_bytes")
            if context is not None and peaks.device_idle_bytes is not None:
                # the backend's baseline is device-wide; what this cell's context added is the
                # part above the idle level the sampler read before the process started
                fields["context_bytes"] = int(context) - peaks.device_idle_bytes
    device_used = peaks.device_used_bytes
    context_bytes = fields.get("context_bytes")
    record = dataclasses.replace(
        job.planned, status=status.value, error=error, started_at=started, wall_s=wall_s,
        exit_code=rc, log=str(err_path.relative_to(store.root)), peak_rss_bytes=peaks.rss_bytes,
        peak_device_used_bytes=device_used, device_peak_method=peaks.device_method,
        peak_device_minus_context_bytes=(device_used - context_bytes
                                         if device_used is not None and context_bytes is not None
                                         else None),
        busy_samples=peaks.busy_samples, sm_clock_mhz_mean=peaks.sm_clock_mhz_mean,
        power_w_mean=peaks.power_w_mean, power_capped_frac=peaks.power_capped_frac,
        **fields)
    store.save(record)
    return record
