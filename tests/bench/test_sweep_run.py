"""dataflow-sweep end to end on the CPU: a 2x2 sweep of `tiny` on the NumPy backend, killed while
its second cell runs and resumed without redoing the finished cell, then plotted; a cell that
overruns its timeout; the submitit executor through its local cluster. Each cell is a real child
process running the demo (~2-4 s each here)."""

import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dataflow.bench.sweep.grid import Cell, expand
from dataflow.bench.sweep.planning import plan_cell
from dataflow.bench.sweep.record import Status
from dataflow.bench.sweep.runner import REPO_ROOT, CellJob, run_cell
from dataflow.bench.sweep.sweep import SweepConfig, run_sweep
from dataflow.bench.sweep.table import SweepStore, read_table

ARGS = ["--model", "tiny", "--seqlen", "128", "--host", "1,2", "--dev", "0.25,0.5", "--steps",
        "2", "--backend", "numpy"]


def _sweep(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dataflow.cli.sweep", "run", *ARGS, "--out", str(out)],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _demo_children(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "dataflow.cli.demo" in " ".join(k.cmdline()):
                out.append(k)
        except psutil.Error:
            pass
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_tiny_sweep_killed_mid_cell_resumes_without_redoing_finished_cells_and_plots(tmp_path):
    """Kill the sweep while its second cell's demo runs: the finished cell's record survives and
    the demo dies with the sweep; running again runs only the three others; a third run runs
    nothing; the plot's heatmaps carry the measured values and the PNGs have their sizes."""
    out = tmp_path / "sweep"
    proc = _sweep(out)
    deadline = time.monotonic() + 120
    while True:  # wait for: one cell finished, the next one's demo running
        finished = list((out / "cells").glob("*.json")) if (out / "cells").exists() else []
        demos = _demo_children(proc.pid)
        if len(finished) == 1 and demos:
            break
        assert proc.poll() is None, f"sweep ended early: {proc.stderr.read()}"
        assert len(finished) < 2 and time.monotonic() < deadline, "never caught cell 2 running"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    proc.stderr.close()
    _, alive = psutil.wait_procs(demos, timeout=5)
    assert not alive, "the cell's demo outlived the killed sweep"
    first = SweepStore(out).load()
    assert len(first) == 1
    (done_cell, done_record), = first.items()
    assert done_record.state is Status.OK
    # the second cell's demo was killed with the sweep (parent-death signal), not left to finish:
    # its --json never came
    cut = [p for p in (out / "logs").glob("*.json") if p.stem != done_cell.slug]
    assert len(cut) == 1 and cut[0].read_text() == ""

    resumed = subprocess.run([sys.executable, "-m", "dataflow.cli.sweep", "run", *ARGS, "--out", str(out)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "4 cell(s), 1 finished already" in resumed.stderr
    assert [ln.split("]")[0] for ln in resumed.stderr.splitlines() if ln.startswith("[")] == \
        ["[1/3", "[2/3", "[3/3"]
    records = {r.cell: r for r in read_table(out)}
    assert set(records) == set(expand(("tiny",), (128,), (1.0, 2.0), (0.25, 0.5)))
    assert records[done_cell] == done_record  # not redone: same run, same numbers
    others = [r for c, r in records.items() if c != done_cell]
    assert len({r.run_id for r in others}) == 1 and others[0].run_id != done_record.run_id
    for r in records.values():
        assert r.state is Status.OK, (r.status, r.error)
        assert r.steps_averaged == 1 and r.tok_per_s > 0 and 0 < r.mfu < 1
        assert r.plan_hash and r.predicted_tok_per_s > 0 and r.device_name == "cpu (numpy)"
        assert r.peak_rss_bytes > 50 * 2**20  # python + numpy + the engine, sampled from outside
        assert r.peak_device_used_bytes is None  # no GPU: null, not zero
        assert r.wall_s > r.steps_time_s > 0
    again = subprocess.run([sys.executable, "-m", "dataflow.cli.sweep", "run", *ARGS, "--out", str(out)],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "4 finished already" in again.stderr
    assert {r.cell: r for r in read_table(out)} == records

    pytest.importorskip("matplotlib")
    from dataflow.bench.sweep.plot import heatmap, plot_sweep, report_metrics

    paths = plot_sweep(out)
    assert [p.name for p in paths] == ["tiny-128-report.png", "tiny-128-predicted.png",
                                       "tiny-128-memory.png"]
    assert [_png_size(p) for p in paths] == [(1600, 1200), (900, 700), (1800, 700)]
    assert all(p.stat().st_size > 20_000 for p in paths)  # drawn, not blank
    table = list(records.values())
    tok = heatmap(table, report_metrics(predicted=False)[0])
    assert tok.hosts == (2.0, 1.0) and tok.devs == (0.25, 0.5)  # host down, largest on top
    for i, h in enumerate(tok.hosts):
        for j, d in enumerate(tok.devs):
            r = records[Cell(model="tiny", seqlen=128, host_gib=h, dev_gib=d)]
            assert tok.values[i][j] == r.tok_per_s
            assert tok.labels[i][j] == f"{r.tok_per_s:,.0f}"


def test_cell_over_its_timeout_is_killed_and_recorded_as_timeout(tmp_path):
    """A cell still running at its timeout is killed with its process group and recorded as a
    timeout, with the measured fields left empty."""
    cell = Cell(model="tiny", seqlen=128, host_gib=1.0, dev_gib=0.25)
    from dataflow.memplan import get_profile

    plan, planned = plan_cell(cell, get_profile("cpu"), backend="numpy", steps=50,
                              run_id="t", commit=None)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    t0 = time.monotonic()
    r = run_cell(CellJob(planned=planned, plan_path=str(path), out=str(tmp_path), timeout_s=1.0))
    assert time.monotonic() - t0 < 20
    assert r.state is Status.TIMEOUT and "within 1 s" in r.error
    assert r.tok_per_s is None and r.wall_s >= 1.0 and r.predicted_tok_per_s > 0
    assert SweepStore(tmp_path).load()[cell] == r


def test_submitit_local_executor_runs_cells_into_the_same_table(tmp_path):
    """The submitit executor (its local cluster standing in for Slurm) runs the cells in jobs
    that save their own records; the table is the same as a local sweep's."""
    pytest.importorskip("submitit")
    from dataflow.bench.sweep.executors import SubmititExecutor

    cells = expand(("tiny",), (128,), (1.0,), (0.25,))  # one job: the path, not the grid, is tested
    executor = SubmititExecutor(str(tmp_path / "submitit"), cluster="local", timeout_s=120)
    out = run_sweep(SweepConfig(cells=cells, out=str(tmp_path / "sweep"), steps=2,
                                backend="numpy"), executor)
    assert [r.cell for r in out] == list(cells)
    for r in out:
        assert r.state is Status.OK, (r.status, r.error)
        assert r.tok_per_s > 0 and r.peak_rss_bytes > 0
    assert read_table(tmp_path / "sweep") == out
