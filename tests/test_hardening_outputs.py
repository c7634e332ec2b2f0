"""Issue 20, what runs leave behind and print: a Chrome trace that is valid JSON after every
step (so an interrupt or kill never leaves it broken), metrics appends that keep every row when
two runs share a file, step lines that say 'recompute 0%' when the plan recomputes nothing and
name the bytes they rate, and refusals that show small budgets in MiB without repeating a hint."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from dataflow.backend import Stream
from dataflow.instrument import ChromeTraceWriter
from dataflow.instrument.breakdown import StepTrace, compute_breakdown
from dataflow.instrument.spans import Clock, Span, SpanKind
from dataflow.metrics_log import read_metrics, read_run_metadata
from dataflow.cli.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]


def _span(stream, a, b, name, nbytes=0):
    return Span(1, 0, stream, name, SpanKind.COPY if nbytes else SpanKind.OP, nbytes, a, b)


def _trace(step, spans, start=0.0, end=10.0):
    return StepTrace(step=step, start_s=start, end_s=end, spans=tuple(spans), clock=Clock.HOST)


def test_chrome_trace_is_valid_json_after_every_step_without_close(tmp_path, rng):
    """A writer that is never closed (the process was killed between steps) leaves a file
    that parses, with every step added so far."""
    path = tmp_path / "t.json"
    w = ChromeTraceWriter(path)
    assert json.loads(path.read_text())["traceEvents"]
    for step in range(1, 4):
        n = int(rng.integers(1, 20))
        starts = np.sort(rng.uniform(0, 9, n))
        spans = [_span(Stream.COMPUTE, float(a), float(a) + 0.5, f"f.L0.c{i}.linear_fwd")
                 for i, a in enumerate(starts)]
        w.add(_trace(step, spans))
        events = json.loads(path.read_text())["traceEvents"]
        assert {e["args"]["step"] for e in events if e.get("cat") == "step"} == \
            set(range(1, step + 1))
    w.close()
    assert len(json.loads(path.read_text())["traceEvents"]) == w.n_events


_WRITER = textwrap.dedent("""
    import sys, time
    from dataflow.metrics_log import MetricsLog
    log = MetricsLog(sys.argv[1], {"run_id": sys.argv[2]})
    for i in range(int(sys.argv[3])):
        time.sleep(0.02)
        log.append()
    log.close(status="done")
""")


def test_two_runs_appending_to_one_parquet_keep_every_row(tmp_path):
    """Two processes appending to one Parquet log at once: all rows and both runs survive
    (before, each rewrote the file from what it read at open, and one run's rows were lost)."""
    path = tmp_path / "m.parquet"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), run, "8"], cwd=ROOT)
             for run in ("run_a", "run_b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    table = read_metrics(path)
    ids = table.column("run_id").to_pylist()
    assert sorted(ids) == ["run_a"] * 8 + ["run_b"] * 8
    runs = {r["run_id"]: r for r in read_run_metadata(path)}
    assert set(runs) == {"run_a", "run_b"} and {r["status"] for r in runs.values()} == {"done"}


def test_two_runs_appending_to_one_csv_keep_every_row_and_both_metadata(tmp_path):
    """The same for CSV: one header, every row, both runs' metadata."""
    path = tmp_path / "m.csv"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), run, "6"], cwd=ROOT)
             for run in ("run_a", "run_b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(read_metrics(path).column("run_id").to_pylist()) == \
        ["run_a"] * 6 + ["run_b"] * 6
    assert {r["run_id"] for r in read_run_metadata(path)} == {"run_a", "run_b"}


def test_breakdown_does_not_count_the_norms_every_level_rederives_as_recompute():
    """Untagged rms_norm_fwd/swiglu_fwd in the backward (done at FULL too) are not recompute;
    q projection, rope and '.re' ops are."""
    spans = [_span(Stream.COMPUTE, 0, 1, "b.L0.c0.rms_norm_fwd"),
             _span(Stream.COMPUTE, 1, 2, "b.L0.c0.swiglu_fwd"),
             _span(Stream.COMPUTE, 2, 6, "b.L0.c0.linear_bwd_w")]
    bd = compute_breakdown(_trace(1, spans))
    assert bd.recompute_s == 0 and "recompute 0%" in bd.summary()
    spans += [_span(Stream.COMPUTE, 6, 7, "b.L0.c0.linear_fwd"),
              _span(Stream.COMPUTE, 7, 8, "b.L0.c0.attention_fwd.re")]
    assert compute_breakdown(_trace(1, spans)).recompute_s == 2


def test_step_line_names_the_bytes_it_rates_and_says_none_for_nothing():
    """16 KiB of token ids read '16 KiB at ... GB/s' (not '0.000 GiB at 1.76 GB/s'); a direction
    that moved nothing reads 'none' (not '0.0 GB/s')."""
    spans = [_span(Stream.COMPUTE, 0, 5, "f.L0.c0.linear_fwd"),
             _span(Stream.H2D, 0, 0.5, "tokens.ids", 16 * 1024)]
    bd = compute_breakdown(_trace(1, spans))
    line, table = bd.summary(), bd.table()
    assert "h2d 16 KiB at 0.0 GB/s" in line and "d2h none" in line
    assert "h2d 16 KiB" in table and "0.000 GiB" not in table


def test_engine_at_full_level_reports_no_recompute():
    """A tiny plan that keeps every activation at FULL: the step's breakdown shows 0 recompute
    (it said 2-4 % on NumPy)."""
    from dataflow.backends import make_backend
    from dataflow.data import token_stream
    from dataflow.engine import Engine, default_profile
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.models.config import load_config
    from dataflow.models.flops import SavedLevel

    plan = make_plan(load_config("tiny"), 64, Budget.from_gib(0.5, 0.25),
                     default_profile(make_backend("numpy")))
    assert all(a.level is SavedLevel.FULL for row in plan.activations for a in row)
    with Engine.from_plan(plan, backend="numpy", trace=True) as eng:
        r = eng.train_step(token_stream(64, eng.seqs_per_step, 512))
    assert r.breakdown.recompute_s == 0 and "recompute 0%" in r.breakdown.summary()


def test_small_budget_refusal_shows_mib_and_no_repeated_hint(capsys):
    """'device 0.1 GiB (20.5 MiB) ... try dev_gb 0.1, or dev_gb 0.1' became MiB numbers and one
    hint."""
    assert plan_main(["0.01", "0.02", "256", "tiny", "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "device 20.5 MiB" in err and "GiB (" not in err
    assert "0.0, " not in err  # categories in MiB, not 'weights 0.0, grads 0.0 GiB'
    assert err.count("dev_gb 0.1") == 1 and len(err.splitlines()) == 1


def test_explain_prints_budgets_below_one_gib_in_mib(capsys):
    """A 0.25 GiB device budget reads '256.0 MiB' in the plan's headline."""
    assert plan_main(["2", "0.25", "256", "tiny", "--gpu", "cpu"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "device 256.0 MiB" in head and "host 2.00 GiB" in head
