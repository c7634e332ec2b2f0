"""The run log reads back with exactly the documented columns in both formats, keeps each run's
metadata once, appends across runs, and refuses unknown extensions; the progress reporter draws
a bar on a terminal and plain lines elsewhere."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest

from dataflow.backend import Stream
from dataflow.engine import StepResult
from dataflow.instrument import Clock, PcieBytes, Span, SpanKind, StepTrace
from dataflow.metrics_log import (COLUMN_NAMES, COLUMNS, MetricsLog, make_row, meta_path,
                                  read_metrics, read_run_metadata, run_metadata)
from dataflow.progress import Progress
from dataflow.models.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "instrumentation.md"


def _step(step: int, rng):
    """A StepResult with random numbers and the breakdown of random non-overlapping spans."""
    t = float(rng.uniform(0.5, 2.0))
    result = StepResult(step=step, loss=float(rng.uniform(2, 8)), round_losses=(3.0, 2.9),
                        tokens=4096, step_time_s=t, tok_per_s=4096 / t,
                        model_tflop_per_s=float(rng.uniform(1, 400)), mfu=0.3, hfu=0.35,
                        flop_model_version="mldf-1", h2d_bytes=1 << 30, d2h_bytes=1 << 29,
                        lr=3e-4, grad_norm=None)
    cuts = sorted(rng.uniform(0, t, 6))
    spans = (Span(step, 0, Stream.COMPUTE, "f.L0.c0.linear_fwd", SpanKind.OP, 0, 0.0, cuts[2]),
             Span(step, 0, Stream.H2D, "w.h2d0", SpanKind.COPY, 1 << 30, cuts[0], cuts[3]),
             Span(step, 0, Stream.D2H, "g.d2h0", SpanKind.COPY, 1 << 29, cuts[4], cuts[5]),
             Span(step, None, Stream.COMPUTE, "adamw.layer0", SpanKind.OP, 0, cuts[5], t))
    trace = StepTrace(step=step, start_s=0.0, end_s=t, spans=spans, clock=Clock.HOST)
    return result, trace.breakdown()


@pytest.mark.parametrize("ext", [".parquet", ".csv"])
def test_log_reads_back_with_exactly_the_documented_columns(ext, tmp_path, rng):
    """Two steps written, the file read back: the documented columns in order, the values
    written, nulls where nothing was known, and the run's metadata stored once."""
    path = tmp_path / f"run{ext}"
    meta = run_metadata(config={"steps": 2, "model": "tiny"})
    rows = []
    with MetricsLog(path, meta) as log:
        for step in (1, 2):
            result, bd = _step(step, rng)
            pcie = PcieBytes(tx_bytes=1 << 29, rx_bytes=(1 << 30) + 4096) if step == 2 else None
            rows.append(log.append(result, breakdown=bd, pcie=pcie))
    table = read_metrics(path)
    assert tuple(table.column_names) == COLUMN_NAMES
    assert [str(t) for t in table.schema.types] == [
        {"float64": "double"}.get(k, k) for _, k, _ in COLUMNS]
    back = table.to_pylist()
    assert len(back) == 2
    for want, got in zip(rows, back, strict=True):
        for name in COLUMN_NAMES:
            if isinstance(want[name], float):
                assert got[name] == pytest.approx(want[name], rel=1e-12), name
            else:
                assert got[name] == want[name], name
    assert back[0]["grad_norm"] is None and back[0]["pcie_h2d_bytes"] is None
    assert back[1]["pcie_h2d_bytes"] == (1 << 30) + 4096 and back[1]["clock"] == "host"
    runs = read_run_metadata(path)
    assert len(runs) == 1 and runs[0]["run_id"] == back[0]["run_id"]
    assert runs[0]["commit"] and runs[0]["package_version"] and runs[0]["config"]["steps"] == 2
    for key in ("device_name", "driver_version", "cupy_version", "cuda_runtime_version",
                "plan_hash"):
        assert key in runs[0]


@pytest.mark.parametrize("ext", [".parquet", ".csv"])
def test_second_run_appends_rows_and_its_own_metadata(ext, tmp_path, rng):
    """Opening an existing log appends: both runs' rows and both metadata entries remain."""
    path = tmp_path / f"run{ext}"
    for _ in range(2):
        with MetricsLog(path, run_metadata()) as log:
            log.append(*_step(1, rng)[:1], breakdown=_step(1, rng)[1])
    table = read_metrics(path)
    runs = read_run_metadata(path)
    assert table.num_rows == 2 and len(runs) == 2
    assert table.column("run_id").to_pylist() == [r["run_id"] for r in runs]
    if ext == ".csv":
        assert meta_path(path).exists()


@pytest.mark.parametrize("ext", [".parquet", ".csv"])
def test_a_log_of_the_version_before_moe_columns_reads_and_appends(ext, tmp_path, rng,
                                                                    monkeypatch):
    """A log written before aux_loss / z_loss existed reads back with them empty, and a new
    run appends to it (the file gains the columns, its old rows empty there); an MoE step's
    router losses land in them."""
    import dataflow.metrics_log as ml

    path = tmp_path / f"old{ext}"
    old = ml.OLDER_COLUMN_NAMES[-1]
    n = len(old)
    with monkeypatch.context() as m:  # this version's writer, as the previous version had it
        m.setattr(ml, "COLUMNS", ml.COLUMNS[:n])
        m.setattr(ml, "COLUMN_NAMES", old)
        with MetricsLog(path, run_metadata()) as log:
            log.append(*_step(1, rng)[:1], breakdown=_step(1, rng)[1])
    before = read_metrics(path)
    assert tuple(before.column_names) == COLUMN_NAMES and before.num_rows == 1
    assert before.column("aux_loss").to_pylist() == [None]
    result, bd = _step(2, rng)
    moe = dataclasses.replace(result, aux_loss=1.25, z_loss=3.5)
    with MetricsLog(path, run_metadata()) as log:
        log.append(moe, breakdown=bd)
    after = read_metrics(path).to_pylist()
    assert [r["aux_loss"] for r in after] == [None, 1.25]
    assert [r["z_loss"] for r in after] == [None, 3.5]
    assert after[0]["loss"] == pytest.approx(before.column("loss").to_pylist()[0], rel=1e-12)
    assert len(read_run_metadata(path)) == 2


def test_unknown_extension_is_refused_naming_the_valid_ones(tmp_path):
    """metrics.json is not a format we write: ConfigError naming .parquet and .csv."""
    with pytest.raises(ConfigError, match=r"\.parquet, \.csv"):
        MetricsLog(tmp_path / "metrics.json")


def test_a_file_with_other_columns_is_refused(tmp_path):
    """A CSV written by something else is never appended to."""
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="log to a new file"):
        MetricsLog(path)


def test_row_takes_the_breakdown_from_the_result_when_it_carries_one(rng):
    """Once StepResult carries `breakdown`, make_row finds it there."""
    result, bd = _step(3, rng)

    class WithBreakdown:
        def __getattr__(self, name):
            return bd if name == "breakdown" else getattr(result, name)

    row = make_row(WithBreakdown(), run_id="r")
    assert row["wall_s"] == bd.wall_s and row["tok_per_s"] == result.tok_per_s
    assert row["compute_idle_s"] == bd.compute_idle_s


def test_docs_list_exactly_the_columns():
    """docs/instrumentation.md's column table names COLUMNS, in order."""
    text = DOC.read_text()
    section = text.split("## Run log columns", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert tuple(documented) == COLUMN_NAMES


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal_and_lines_elsewhere():
    """On a TTY the bar is redrawn in place (carriage returns, one final newline); elsewhere
    each printed line stands alone and the last one reports completion."""
    tty = _Tty()
    with Progress(4, "init", stream=tty) as bar:
        for _ in range(4):
            bar.update(info="layer")
        bar.info("a log line %d", 7)
    out = tty.getvalue()
    assert out.count("\r") >= 4 and "[" + "#" * 28 + "]" in out and out.endswith("\n")
    assert "a log line 7\n" in out
    plain = io.StringIO()
    with Progress(3, "steps", stream=plain, interval_s=3600) as bar:
        for _ in range(3):
            bar.update()
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert lines[0].startswith("steps: 1/3") and lines[-1].startswith("steps: 3/3 (100%)")
    assert len(lines) == 2  # the first and the last; the rest fall inside the interval
