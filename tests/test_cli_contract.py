"""Issue 37, rows 9-12, the command lines as a new user meets them: concurrent sweeps into one
directory keep every row; bad --data files, huge seqlens, --eval-every 0 and a missing plot
directory exit 2 with one line and create nothing; dataflow-plan says which hardware it planned
for and lists memory parts that add up; the demo ends with a summary line, tells one story of
where an interrupted run stopped, warns once on a zero gradient norm; every command has
--version; no .lock stays beside a metrics file; the docs state the code's default lr."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import dataflow
from dataflow.cli import demo as demo_mod
from dataflow.cli.demo import main as demo_main
from dataflow.bench.sweep import sweep as sweep_mod
from dataflow.cli.sweep import main as sweep_main
from dataflow.bench.sweep.grid import expand
from dataflow.bench.sweep.record import CellRecord
from dataflow.bench.sweep.table import CSV, SweepStore, read_table
from dataflow.cli import plan as plan_cli
from dataflow.memplan.plan.chunking import MAX_SEQLEN

ROOT = Path(__file__).resolve().parents[1]
FAST = ["0.5", "0.25", "64", "tiny", "--backend", "numpy"]
"""A demo whose steps take about a second on the NumPy backend."""


def _code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own refusals and --version
        return int(exc.code or 0)


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# -- row 9: concurrent sweeps into one directory ------------------------------------------------
def _record(rng, cell, run_id: str) -> CellRecord:
    return CellRecord(model=cell.model, seqlen=cell.seqlen, host_gib=cell.host_gib,
                      dev_gib=cell.dev_gib, host_budget_bytes=int(cell.host_gib * 2**30),
                      device_budget_bytes=int(cell.dev_gib * 2**30), status="ok",
                      backend="numpy", profile="cpu", run_id=run_id, steps=2,
                      tok_per_s=float(rng.uniform(1e3, 1e4)))


def test_two_sweeps_keeping_cells_in_turn_leave_every_row_in_the_table(tmp_path, rng):
    """Two sweeps, each with its own in-memory records, save cells into one directory in turn
    through the sweep's own _keep: the table ends with all 50 rows (it used to hold only the
    last writer's 25)."""
    cells = expand(("tiny",), (128,), tuple(float(h) for h in range(1, 11)),
                   (0.25, 0.5, 0.75, 1.0, 1.25))
    halves = (cells[::2], cells[1::2])
    stores, mine = (SweepStore(tmp_path), SweepStore(tmp_path)), ({}, {})
    for a, b in zip(*halves):
        sweep_mod._keep(stores[0], mine[0], _record(rng, a, "first"))
        sweep_mod._keep(stores[1], mine[1], _record(rng, b, "second"))
    table = read_table(tmp_path)
    assert sorted(r.cell.key for r in table) == sorted(c.key for c in cells)
    assert len((tmp_path / CSV).read_text().splitlines()) == 1 + len(cells)


def test_writers_in_threads_racing_on_one_table_lose_no_rows(tmp_path, rng):
    """Four threads save and rebuild the table at once (the lock is on the directory, so each
    thread's open of it competes): every one of the 40 records is in the final table."""
    cells = expand(("tiny",), (64,), tuple(float(h) for h in range(1, 11)),
                   (0.25, 0.5, 0.75, 1.0))
    records = [_record(rng, c, f"t{i % 4}") for i, c in enumerate(cells)]
    errors = []

    def writer(k):
        try:
            store, mine = SweepStore(tmp_path), {}
            for r in records[k::4]:
                sweep_mod._keep(store, mine, r)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(r.cell.key for r in read_table(tmp_path)) == sorted(c.key for c in cells)


def test_two_concurrent_sweep_processes_into_one_out_keep_all_50_rows(tmp_path):
    """`dataflow-sweep run --predict-only` twice at once into one --out (25 cells each, as in
    the issue): the table has all 50 rows and no lock file is left in the directory."""
    out = tmp_path / "sweep"
    common = ["--predict-only", "--gpu", "h100", "--model", "tiny", "--seqlen", "128",
              "--dev", "0.25:1.25:0.25", "--out", str(out)]
    procs = [subprocess.Popen([sys.executable, "-m", "dataflow.cli.sweep", "run", "--host",
                               hosts, *common], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for hosts in ("1:5:1", "6:10:1")]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    assert len(read_table(out)) == 50
    assert len(list((out / "cells").glob("*.json"))) == 50
    assert not [p.name for p in out.rglob("*") if p.name.endswith((".lock", ".tmp"))]


# -- row 10: bad inputs exit 2 with one line and create nothing ---------------------------------
def _bad_data(tmp_path: Path, kind: str) -> str:
    if kind == "/dev/zero":
        return kind
    path = tmp_path / {"empty npy": "e.npy", "empty txt": "e.txt", "garbage npy": "g.npy",
                       "object npy": "o.npy", "truncated npy": "t.npy"}[kind]
    rng = np.random.default_rng(7)
    if kind == "garbage npy":
        path.write_bytes(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    elif kind == "object npy":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif kind == "truncated npy":
        np.save(path, rng.integers(0, 256, 1000).astype(np.int32))
        path.write_bytes(path.read_bytes()[:300])
    else:
        path.write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("kind, words", [
    ("empty npy", "is empty (0 bytes)"), ("/dev/zero", "is not a regular file"),
    ("empty txt", "is empty (0 bytes)"), ("garbage npy", "is not a NumPy .npy file"),
    ("object npy", "holds Python objects"), ("truncated npy", "truncated or damaged"),
])
def test_demo_refuses_a_bad_data_file_naming_it_before_any_work(capsys, tmp_path, kind, words):
    """Each bad --data exits 2 with one line naming the file and its problem, before the
    engine is built: the --trace and --metrics files are not created."""
    data = _bad_data(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = _code(demo_main, [*FAST, "--steps", "1", "--data", data, "--trace",
                             str(tmp_path / "t.json"), "--metrics", str(tmp_path / "m.parquet")])
    err = _one_line(capsys, code)
    assert f"--data {data} " in err and words in err
    assert "allow_pickle" not in err and "EOFError" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("main", [demo_main, plan_cli.main], ids=["demo", "plan"])
@pytest.mark.parametrize("seqlen", ["1e20", "16777217"])
def test_a_too_large_seqlen_is_called_too_large_and_names_the_maximum(capsys, main, seqlen):
    """1e20 is a whole number, just far too large: the refusal says so and names 16,777,216."""
    err = _one_line(capsys, _code(main, ["2", "0.25", seqlen, "tiny"]))
    assert "too large" in err and f"{MAX_SEQLEN:,}" in err and "not a whole number" not in err


def test_plan_reads_a_whole_seqlen_written_with_an_exponent(capsys):
    """'8e3' is 8000 tokens, not a refusal."""
    assert plan_cli.main(["1", "1", "8e3", "tiny", "--gpu", "cpu"]) == 0
    assert "seqlen 8,000" in capsys.readouterr().out


def test_eval_every_0_is_refused_with_a_hint(capsys):
    """--eval-every 0 would never validate: exit 2 pointing to N >= 1 or leaving it out."""
    err = _one_line(capsys, _code(demo_main, [*FAST, "--eval-every", "0"]))
    assert "--eval-every" in err and "at least 1" in err and "leave --eval-every out" in err


def test_plot_of_a_missing_directory_creates_nothing(capsys, tmp_path, monkeypatch):
    """`dataflow-sweep plot no-such-dir` exits 2 naming it and does not create it."""
    monkeypatch.chdir(tmp_path)
    err = _one_line(capsys, sweep_main(["plot", "no-such-dir"]))
    assert "no-such-dir does not exist" in err
    assert not (tmp_path / "no-such-dir").exists()


def test_plot_without_matplotlib_names_the_extra_and_writes_nothing(capsys, tmp_path,
                                                                    monkeypatch):
    """With matplotlib not importable, plotting a real table exits 2 naming
    pip install 'dataflow[plot]', and the --to directory is not created."""
    out = tmp_path / "s"
    assert sweep_main(["run", "--predict-only", "--gpu", "h100", "--model", "tiny", "--seqlen",
                       "128", "--host", "1", "--dev", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    err = _one_line(capsys, sweep_main(["plot", str(out), "--to", str(tmp_path / "png")]))
    assert "pip install 'dataflow[plot]'" in err
    assert not (tmp_path / "png").exists()


# -- row 11: dataflow-plan names its hardware; its memory parts add up ---------------------------
def _parts_mib(err: str) -> tuple[float, list[float]]:
    total, listed = re.search(r"needs device ([\d.]+) MiB \((.*?) MiB\)", err).groups()
    return float(total), [float(part.rsplit(" ", 1)[1]) for part in listed.split(", ")]


def test_plan_of_the_demos_numbers_without_a_gpu_points_to_the_cpu_profile(capsys,
                                                                           monkeypatch):
    """`dataflow-plan 2 0.25 256 tiny` on a machine without a GPU: the refusal names the h100
    profile it planned for and `--gpu cpu`; its device parts (library reserve included) add up
    to the total it names; with --gpu cpu the same numbers plan, saying so."""
    monkeypatch.setattr(plan_cli, "_local_gpu", lambda: False)
    err = _one_line(capsys, plan_cli.main(["2", "0.25", "256", "tiny"]))
    assert "'h100' profile" in err and "--gpu cpu" in err and "no GPU" in err
    total, parts = _parts_mib(err)
    assert "library reserve" in err
    assert abs(sum(parts) - total) <= 0.1 * len(parts), (total, parts)
    assert plan_cli.main(["2", "0.25", "256", "tiny", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "Hardware: planned for the 'cpu' profile (--gpu cpu)."
    assert "does not fit" not in out


def test_plan_on_a_gpu_machine_names_the_default_profile_without_the_cpu_hint(capsys,
                                                                              monkeypatch):
    """With a GPU present the text names the profile planned for and suggests --gpu NAME, not
    the NumPy backend's profile; --json stays one document with nothing on stderr."""
    monkeypatch.setattr(plan_cli, "_local_gpu", lambda: True)
    assert plan_cli.main(["2", "1", "256", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("Hardware: planned for the 'h100' profile (the "
                                           "default; --gpu NAME")
    assert "--gpu cpu" not in out and err == ""
    assert plan_cli.main(["2", "1", "256", "tiny", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["profile"]["name"] == "h100" and err == ""


# -- row 12: summary, --version, one story of a stop, zero gradients, no .lock -----------------
def test_demo_ends_with_a_summary_line_on_stdout(capsys):
    """Without --json stdout holds one summary line: total time, mean tok/s of the steps after
    the first, first -> last loss; with --json the same line goes to stderr and agrees with the
    document's steps."""
    assert demo_main([*FAST, "--steps", "3", "--seed", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("summary: tiny done: 3 step(s) in "), out
    assert demo_main([*FAST, "--steps", "3", "--seed", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    line = next(x for x in err.splitlines() if x.startswith("summary: "))
    steps = doc["steps"]
    mean = sum(s["tok_per_s"] for s in steps[1:]) / 2
    assert f"{mean:,.0f} tok/s mean over steps 2-3" in line, line
    assert f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}" in line, line
    total_s = float(re.search(r"in ([\d.]+) s", line).group(1))
    assert total_s >= doc["setup"]["init_s"] + sum(s["step_time_s"] for s in steps) - 0.1


@pytest.mark.parametrize("prog, main", [
    ("dataflow-demo", "dataflow.cli.demo"), ("dataflow-plan", "dataflow.cli.plan"),
    ("dataflow-sweep", "dataflow.cli.sweep"), ("dataflow-ring", "dataflow.cli.ring"),
    ("dataflow-export", "dataflow.cli.export"), ("dataflow-data", "dataflow.cli.data"),
])
def test_every_command_prints_its_version(capsys, prog, main):
    """--version prints 'PROG VERSION' with dataflow.__version__ and exits 0."""
    import importlib

    assert _code(importlib.import_module(main).main, ["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"{prog} {dataflow.__version__}"


@pytest.mark.parametrize("done, status, words", [
    (2, None, "interrupted at step 2"),
    (2, "interrupted at step 2", "interrupted at step 2"),
    (2, "interrupted in step 3", "interrupted in step 3 (abandoned it; 2 step(s) finished)"),
    (0, None, "interrupted at step 0 (before the first step)"),
])
def test_stop_words_start_with_the_status_the_json_and_metrics_record(done, status, words):
    """stderr's line is the --json / --metrics status itself, with what it means added."""
    args = SimpleNamespace(steps_done=done, **({"stop_status": status} if status else {}))
    assert demo_mod._stop_words(args) == words


def test_a_second_signal_mid_step_tells_one_story_on_stderr_and_in_json(tmp_path):
    """Two SIGINTs inside step 2 abandon it: stderr's last line and the JSON status both say
    where it stopped, in the same words, and the JSON holds exactly the finished steps."""
    cmd = [sys.executable, "-m", "dataflow.cli.demo", "0.5", "0.25", "128", "tiny",
           "--backend", "numpy", "--steps", "50", "--json"]
    with open(tmp_path / "out.json", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("step 1:"):
                break
        time.sleep(0.3)  # inside step 2 (a step takes about a second here)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    assert proc.returncode == 130 and "Traceback" not in err, err
    doc = json.loads((tmp_path / "out.json").read_text())
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dataflow-demo: {doc['status']}"), (last, doc["status"])
    n = len(doc["steps"])
    assert doc["status"] in (f"interrupted in step {n + 1}", f"interrupted at step {n}")
    summary = next(x for x in err.splitlines() if x.startswith("summary: "))
    assert f"tiny {demo_mod._stop_words(SimpleNamespace(steps_done=n, stop_status=doc['status']))}" \
        in summary


def test_a_zero_gradient_norm_is_warned_about_once(caplog):
    """Steps whose gradient norm is exactly 0 (the weights never move) get one warning on the
    demo's logger (stderr), however many there are; non-zero norms get none."""
    run = demo_mod._Run.__new__(demo_mod._Run)
    run._warned, run.results = set(), []
    with caplog.at_level("WARNING", logger="dataflow.demo"):
        for step, norm in enumerate([0.7, 0.0, 0.0, 0.0], start=1):
            r = SimpleNamespace(step=step, loss=5.5, grad_norm=norm)
            run.results.append(r)
            run._warn_once(r)
    warned = [rec.getMessage() for rec in caplog.records if "gradient norm" in rec.getMessage()]
    assert len(warned) == 1 and "step 2's gradient norm is exactly 0" in warned[0]


def _append_rows(path: str, n: int) -> None:
    from dataflow.metrics_log import MetricsLog

    with MetricsLog(path) as log:
        for _ in range(n):
            log.append()


def test_metrics_writers_leave_no_lock_file_and_lose_no_rows(tmp_path):
    """Two processes appending to one Parquet log at once keep all their rows, and no
    '<log>.lock' (or temporary file) stays beside it once they close."""
    from dataflow.metrics_log import read_metrics

    path = tmp_path / "m.parquet"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
            f"from test_cli_contract import _append_rows; _append_rows({str(path)!r}, 15)")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert read_metrics(path).num_rows == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.parquet"]
    _append_rows(str(tmp_path / "m.csv"), 2)
    assert not (tmp_path / "m.csv.lock").exists()


def test_readme_and_docs_state_the_demos_default_peak_lr():
    """The README and docs/training-runs.md give the defaults default_lr returns: 1e-3 for
    tiny and small, 3e-4 up to width 2048, 1.5e-4 for 8b."""
    from dataflow.cli.demo_training import default_lr
    from dataflow.models.config import load_config

    assert [default_lr(load_config(m).model_dim) for m in ("tiny", "small", "1b", "8b")] == \
        [1e-3, 1e-3, 3e-4, 1.5e-4]
    for doc in ("README.md", "docs/training-runs.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert re.search(r"1e-3 for (`tiny` and `small`|tiny/small)", text), doc
        assert "3e-4 up to" in text and "1.5e-4 for 8b" in text, doc
