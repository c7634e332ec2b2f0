"""dataflow-sweep pieces that need no child process: grid parsing, failure classes, the record
schema and its table, planner-only cells, and the CLI's refusals."""

import csv
import dataclasses
import signal

import pytest

from dataflow.bench.sweep.classify import classify
from dataflow.cli.sweep import main
from dataflow.bench.sweep.grid import Cell, expand, parse_ints, parse_numbers
from dataflow.bench.sweep.record import COLUMNS, DERIVED, SCHEMA_VERSION, CellRecord, Status
from dataflow.bench.sweep.sweep import SweepConfig, run_sweep
from dataflow.bench.sweep.table import SweepStore, read_table
from dataflow.models.errors import ConfigError


def test_range_includes_stop_and_merges_with_lists(rng):
    """'a:b:s' gives a, a+s, ... up to b inclusive, exactly in decimal, merged and sorted."""
    start, step, n = int(rng.integers(1, 50)), int(rng.integers(1, 9)), int(rng.integers(2, 7))
    stop = start + step * (n - 1)
    extra = stop + int(rng.integers(1, 5))
    got = parse_numbers(f"{extra},{start}:{stop}:{step}", "--dev")
    assert got == tuple(float(v) for v in [*range(start, stop + 1, step), extra])
    assert parse_numbers("0.1:0.3:0.1") == (0.1, 0.2, 0.3)


@pytest.mark.parametrize("text, words", [("16:8:4", "stop >= start"), ("8:16", "start:stop"),
                                         ("x", "'x' is not a number"), ("0,8", "not positive"),
                                         ("1:2000:1", "more than"), ("", "no values")])
def test_bad_grid_text_is_refused_with_the_value_and_an_example(text, words):
    """A bad list or range names what is wrong and shows a form that works."""
    with pytest.raises(ConfigError, match=words):
        parse_numbers(text, "--dev")


def test_seqlen_must_be_whole():
    """--seqlen 8192.5 is refused by name."""
    with pytest.raises(ConfigError, match="8192.5 is not a whole number"):
        parse_ints("8192.5", "--seqlen")


def test_grid_expands_model_seqlen_host_dev_and_slugs_are_unique(rng):
    """Every combination once; every cell has its own record file name."""
    hosts = tuple(sorted({float(v) for v in rng.integers(1, 100, 4)}))
    devs = tuple(sorted({float(v) / 4 for v in rng.integers(1, 100, 3)}))
    cells = expand(("tiny", "/some/dir/tiny"), (128, 256), hosts, devs)
    assert len(cells) == 2 * 2 * len(hosts) * len(devs)
    assert len({c.slug for c in cells}) == len(cells)
    assert all("/" not in c.slug for c in cells)


@pytest.mark.parametrize("rc, stderr, timed_out, status, line", [
    (0, "loss 1.0\n", False, Status.OK, None),
    (1, "Traceback\ndataflow-demo: failed while running: BackendError: cannot allocate the "
        "device arena of 80.00 GiB: Out of memory; lower the budget\n", False, Status.DEVICE_OOM,
     "lower the budget"),
    (1, "dataflow-demo: failed while running: OutOfMemoryError: Out of memory allocating "
        "1,024 bytes\n", False, Status.DEVICE_OOM, "allocating"),
    (1, "dataflow-demo: failed while running: BackendError: cannot allocate the host arena of "
        "90.00 GiB: cudaErrorMemoryAllocation: out of memory\n", False, Status.HOST_OOM,
     "host arena"),
    (-signal.SIGKILL, "init 8b: 3/34\n", False, Status.HOST_OOM, "OOM killer"),
    (-signal.SIGSEGV, "step 1\n", False, Status.CRASH, "SIGSEGV"),
    (1, "x\nValueError: bad thing\n\n", False, Status.CRASH, "ValueError: bad thing"),
    (-signal.SIGKILL, "init\n", True, Status.TIMEOUT, "within 5 s"),
])
def test_failures_are_classified_from_exit_code_and_stderr(rc, stderr, timed_out, status, line):
    """Device OOM, host OOM (a pinned refusal is host, though CUDA says 'memory allocation'),
    timeout and crash, each with the error's last line."""
    got, error = classify(rc, stderr, timed_out=timed_out, timeout_s=5)
    assert got is status
    assert (error is None) if line is None else (line in error)


def _record(rng, cell: Cell, **fields) -> CellRecord:
    return CellRecord(model=cell.model, seqlen=cell.seqlen, host_gib=cell.host_gib,
                      dev_gib=cell.dev_gib, host_budget_bytes=int(cell.host_gib * 2**30),
                      device_budget_bytes=int(cell.dev_gib * 2**30), status="ok",
                      backend="numpy", profile="cpu", run_id="r", steps=3,
                      tok_per_s=float(rng.uniform(1e3, 1e4)),
                      predicted_tok_per_s=float(rng.uniform(1e3, 1e4)),
                      peak_rss_bytes=int(rng.integers(1, 2**30)), **fields)


def test_table_round_trips_through_parquet_and_csv_with_a_header(tmp_path, rng):
    """Records saved and tabled come back equal from Parquet; the CSV has the schema's header
    and the derived ratios."""
    store = SweepStore(tmp_path)
    cells = expand(("tiny",), (128,), (1.0, 2.0), (0.25, 0.5))
    records = [_record(rng, c, chunk_tokens=int(rng.integers(1, 9999))) for c in cells]
    for r in records:
        store.save(r)
    assert sorted(store.load().values(), key=lambda r: r.cell.key) == records
    store.write_table(records)
    assert read_table(tmp_path) == records
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS) + list(DERIVED)
    for row, r in zip(rows, records):
        assert float(row["tok_per_s"]) == r.tok_per_s
        assert float(row["predicted_over_measured"]) == pytest.approx(
            r.predicted_tok_per_s / r.tok_per_s)
        assert row["error"] == "" and int(row["schema_version"]) == SCHEMA_VERSION


def test_other_schema_versions_and_unknown_columns_are_refused(rng):
    """A record of another schema version, or with a column this version lacks, is refused by
    name rather than read wrongly."""
    row = _record(rng, Cell(model="tiny", seqlen=128, host_gib=1.0, dev_gib=0.25)).to_row()
    with pytest.raises(ConfigError, match="schema_version 99"):
        CellRecord.from_row({**row, "schema_version": 99})
    with pytest.raises(ConfigError, match=r"unknown columns \['tok_per_sec'\]"):
        CellRecord.from_row({**row, "tok_per_sec": 1.0})
    with pytest.raises(ConfigError, match="status 'fine' is unknown"):
        CellRecord.from_row({**row, "status": "fine"})


class _NoProcesses:
    name = "forbidden"

    def __init__(self):
        self.jobs = []

    def run(self, jobs):
        self.jobs.extend(jobs)
        for job in jobs:  # stands in for a run: the planned record, marked ok
            yield dataclasses.replace(job.planned, status="ok", tok_per_s=1.0, wall_s=0.1)


def test_predict_only_and_infeasible_cells_start_no_process(tmp_path, rng):
    """--predict-only fills every cell from the planner; refused budgets are recorded as
    infeasible with the smallest working budgets; the executor is never asked to run either."""
    tiny_dev = float(rng.uniform(1e-4, 1e-3))  # far below tiny's ~33 MiB minimum
    cells = expand(("tiny",), (128,), (1.0,), (tiny_dev, 0.25))
    fake = _NoProcesses()
    out = run_sweep(SweepConfig(cells=cells, out=str(tmp_path), backend="numpy",
                                predict_only=True), fake)
    assert fake.jobs == []
    bad, good = out
    assert bad.state is Status.INFEASIBLE and bad.min_device_bytes > bad.device_budget_bytes
    assert "does not fit" in bad.error and bad.wall_s is None
    assert good.state is Status.PREDICTED and good.predicted_tok_per_s > 0
    assert good.plan_hash and good.chunk_tokens > 0 and good.tok_per_s is None
    # a measuring sweep runs the predicted cell (planner-only does not finish it) but not the
    # infeasible one; a second one runs nothing; --redo runs the runnable cell again
    config = SweepConfig(cells=cells, out=str(tmp_path), backend="numpy")
    run_sweep(config, fake)
    assert [j.planned.cell for j in fake.jobs] == [cells[1]]
    run_sweep(config, fake)
    assert len(fake.jobs) == 1
    run_sweep(dataclasses.replace(config, redo=True), fake)
    assert [j.planned.cell for j in fake.jobs] == [cells[1], cells[1]]
    assert read_table(tmp_path)[1].state is Status.OK


@pytest.mark.parametrize("argv, words", [
    (["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "8:4:1", "--out", "x"],
     "stop >= start"),
    (["run", "--model", "llama8b", "--seqlen", "128", "--host", "1", "--dev", "1", "--out", "x",
      "--predict-only"], "unknown model"),
    (["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "1", "--out", "x",
      "--steps", "0"], "must be positive"),
    (["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "1", "--out", "x",
      "--cluster", "local"], "submitit only"),
    (["plot", "nowhere"], "sweep directory nowhere does not exist"),
    ([], "say run or plot"),
])
def test_cli_refuses_bad_input_with_exit_2_and_one_line(argv, words, capsys, tmp_path,
                                                        monkeypatch):
    """Bad grids, unknown models, bad flags and missing tables exit 2 with one line, no
    traceback."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_cupy_sweep_without_a_gpu_is_refused_before_any_cell(capsys, tmp_path):
    """--backend cupy on a machine NVML shows no GPU exits 2 naming the way out, writing
    nothing; the same grid with --predict-only plans for the H100 instead."""
    from dataflow.bench.sweep.planning import gpu_names

    if gpu_names():
        pytest.skip("a GPU is present")
    argv = ["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "1",
            "--backend", "cupy", "--out", str(tmp_path / "s")]
    assert main(argv) == 2
    assert "--predict-only" in capsys.readouterr().err
    assert not (tmp_path / "s" / "cells").exists()
    assert main([*argv, "--predict-only"]) == 0
    (r,) = read_table(tmp_path / "s")
    assert r.state is Status.PREDICTED and r.profile == "h100" and r.backend == "cupy"


def test_predict_only_with_no_backend_named_plans_for_the_h100_without_a_gpu(tmp_path):
    """A laptop's --predict-only (backend auto) shows the GPU plane, not the NumPy backend's."""
    from dataflow.bench.sweep.planning import gpu_names

    if gpu_names():
        pytest.skip("a GPU is present")
    assert main(["run", "--model", "1b", "--seqlen", "8192", "--host", "20", "--dev", "16",
                 "--predict-only", "--out", str(tmp_path / "p")]) == 0
    (r,) = read_table(tmp_path / "p")
    assert r.profile == "h100" and r.predicted_tok_per_s > 10_000


def test_heatmap_labels_a_grid_cell_without_a_record_not_run(rng):
    """A slice of a grid (three of four cells ran) shows the missing cell as 'not run', not a
    blank that reads like a failure or a zero."""
    from dataflow.bench.sweep.plot import NOT_RUN_TEXT, heatmap, report_metrics

    cells = expand(("tiny",), (128,), (1.0, 2.0), (0.25, 0.5))
    records = [_record(rng, c) for c in cells if (c.host_gib, c.dev_gib) != (2.0, 0.5)]
    hm = heatmap(records, report_metrics(predicted=False)[0])
    by_cell = {(h, d): hm.labels[i][j] for i, h in enumerate(hm.hosts)
               for j, d in enumerate(hm.devs)}
    assert by_cell[(2.0, 0.5)] == NOT_RUN_TEXT and hm.values[0][1] is None
    r = next(r for r in records if (r.host_gib, r.dev_gib) == (1.0, 0.25))
    assert by_cell[(1.0, 0.25)] == f"{r.tok_per_s:,.0f}"


def test_fast_attention_sweep_plans_with_it_and_one_directory_holds_one_kind(tmp_path, capsys):
    """--fast-attention plans every cell with the atomic-dQ backward (the plan JSON the demo
    runs carries it; the table has a column for it and predicts more for 1b at 8k); resuming
    that directory without the flag, or a deterministic one with it, is refused with the way
    out, before any cell."""
    from dataflow.bench.sweep.planning import gpu_names

    if gpu_names():
        pytest.skip("a GPU is present")
    base = ["run", "--model", "1b", "--seqlen", "8192", "--host", "40", "--dev", "16",
            "--predict-only"]
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert main([*base, "--fast-attention", "--out", str(tmp_path / "f")]) == 0
    (det,), (fast,) = read_table(tmp_path / "d"), read_table(tmp_path / "f")
    assert (det.attention_bwd, fast.attention_bwd) == ("deterministic", "fast")
    assert fast.predicted_tok_per_s > det.predicted_tok_per_s and fast.plan_hash != det.plan_hash
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "f")]) == 2
    assert "fast attention backward; run with --fast-attention" in capsys.readouterr().err
    assert main([*base, "--fast-attention", "--out", str(tmp_path / "d")]) == 2
    assert "deterministic attention backward; run without" in capsys.readouterr().err


def test_git_commit_of_an_archived_tree_is_the_archived_commit_not_the_enclosing_repos(tmp_path):
    """Records made in a `git archive` export (the GPU machine runs one inside another checkout)
    name the archived commit; a checkout names its HEAD; a plain folder names none."""
    import shutil
    import subprocess

    from dataflow.bench.sweep.sweep import REPO_ROOT, git_commit

    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    inside = REPO_ROOT / ".pytest-archive" / tmp_path.name
    inside.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "HEAD",
                                  "bench/ARCHIVE_COMMIT"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(inside)], input=archive.stdout, check=True)
        got = git_commit(inside)
        assert got is not None and got.endswith("+archive") and head.startswith(got[:-8])
        (inside / "bench" / "ARCHIVE_COMMIT").write_text("$Format:%h$\n")
        assert git_commit(inside) is None
    finally:
        shutil.rmtree(REPO_ROOT / ".pytest-archive")
    assert not git_commit(REPO_ROOT).endswith("+archive")
    assert git_commit(tmp_path) is None


def test_an_fp8_sweep_plans_in_fp8_and_one_directory_holds_one_precision(tmp_path, capsys):
    """--precision fp8 plans every cell in fp8 (its column says so; the H200 profile's measured
    FP8 rate predicts more for 8b at 8k); a bf16 resume of that directory is refused by name."""
    base = ["run", "--model", "8b", "--seqlen", "8192", "--host", "80", "--dev", "24",
            "--predict-only", "--gpu", "h200"]
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    assert main([*base, "--precision", "fp8", "--out", str(tmp_path / "f")]) == 0
    (bf16,), (fp8,) = read_table(tmp_path / "b"), read_table(tmp_path / "f")
    assert (bf16.precision, fp8.precision) == ("bf16", "fp8")
    assert fp8.predicted_tok_per_s > bf16.predicted_tok_per_s
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "f")]) == 2
    assert "planned in fp8; run with --precision fp8" in capsys.readouterr().err
