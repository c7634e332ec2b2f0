"""Issue 20, the CLIs under bad input and interruptions: every bad number, path or plan file is
refused up front with exit 2 and one line; huge sequence lengths are refused fast and planning
stays fast up to the stated maximum; NaN stops the demo with exit 3 and a marked metrics row;
SIGINT/SIGTERM stop it between steps with exit 130/143 and every output file closed and valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataflow.cli import demo_checks
from dataflow.cli.demo import main as demo_main
from dataflow.memplan.plan.chunking import MAX_SEQLEN, _divisors
from dataflow.cli.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
FAST = ["0.5", "0.25", "64", "tiny"]
"""A demo whose steps take about a second on the NumPy backend."""


def _one_line_refusal(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,bad", [
    (["inf", "0.25", "256", "tiny"], "inf"),
    (["2", "1e999", "256", "tiny"], "1e999"),
    (["2", "nan", "256", "tiny"], "nan"),
    (["2", "0.25", "256", "tiny", "--lr", "inf"], "inf"),
    (["2", "0.25", "256", "tiny", "--seed", "-1"], "-1"),
])
def test_demo_refuses_non_finite_numbers_with_exit_2(capsys, argv, bad):
    """inf/1e999/nan budgets and lr are refused at parse time, not as an OverflowError."""
    err = _one_line_refusal(capsys, demo_main(argv))
    assert bad in err


@pytest.mark.parametrize("main", [demo_main, plan_main], ids=["demo", "plan"])
def test_huge_seqlen_is_refused_at_once_naming_the_maximum(capsys, main):
    """10^20 tokens used to hang in trial division; now exit 2 in well under a second."""
    t0 = time.perf_counter()
    try:
        code = main(["2", "0.25", "99999999999999999999", "tiny"])
    except SystemExit as exc:
        code = exc.code
    assert time.perf_counter() - t0 < 2
    assert f"{MAX_SEQLEN:,}" in _one_line_refusal(capsys, code)


@pytest.mark.parametrize("seqlen", [MAX_SEQLEN, MAX_SEQLEN - 1, MAX_SEQLEN - 3, 12_582_912])
def test_planning_up_to_the_maximum_seqlen_is_fast(capsys, seqlen):
    """Powers of two, odd and prime-ish lengths up to MAX_SEQLEN plan (or refuse) in seconds
    (16M tokens took 9 s before, 10^20 never finished)."""
    t0 = time.perf_counter()
    code = plan_main(["8000", "80", str(seqlen), "tiny"])
    assert code in (0, 2) and time.perf_counter() - t0 < 5


def test_divisors_match_brute_force(rng):
    """The factorising divisor list equals trial division on random and edge values."""
    values = [1, 2, 3, 4, 97, 1 << 20, MAX_SEQLEN] + [int(x) for x in
                                                      rng.integers(1, 200_000, size=60)]
    for n in values:
        brute = [d for d in range(1, n + 1) if n % d == 0] if n <= 200_000 else None
        got = _divisors(n)
        assert got == sorted(got) and all(n % d == 0 for d in got)
        if brute is not None:
            assert got == brute, n
    assert _divisors(MAX_SEQLEN) == [1 << k for k in range(25)]


def test_demo_refuses_missing_plan_and_unwritable_outputs_writing_nothing(capsys, tmp_path,
                                                                        monkeypatch):
    """--plan missing.json, --metrics/--trace in a missing folder, or a folder as --trace: exit 2
    before anything starts, and no file appears."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    for extra in (["--plan", "missing.json"], ["--metrics", "nodir/x.csv"],
                  ["--trace", "nodir/t.json"], ["--trace", "adir"]):
        assert extra[1] in _one_line_refusal(capsys, demo_main(["2", "0.25", "256", "tiny",
                                                                *extra]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]
    assert not any((tmp_path / "adir").iterdir())


def _refuse_engine(monkeypatch):
    """Fail the test if the demo gets as far as building (allocating) an Engine."""
    from dataflow.engine import Engine

    def boom(*a, **k):
        raise AssertionError("the demo allocated before refusing")
    monkeypatch.setattr(Engine, "from_plan", classmethod(boom))


def test_demo_refuses_a_plan_file_that_disagrees_with_the_positionals(capsys, tmp_path,
                                                                     monkeypatch):
    """A plan for seqlen 128 with positionals saying 256 is refused before initialisation,
    naming both; so is --rounds beside --plan."""
    _refuse_engine(monkeypatch)
    plan = tmp_path / "p.json"
    assert plan_main(["2", "1", "128", "tiny", "--json"]) == 0
    plan.write_text(capsys.readouterr().out)
    err = _one_line_refusal(capsys, demo_main(["2", "1", "256", "tiny", "--plan", str(plan),
                                              "--backend", "numpy"]))
    assert "seqlen 128 (not 256)" in err and "2 1 128 tiny" in err
    err = _one_line_refusal(capsys, demo_main(["3", "1", "128", "tiny", "--plan", str(plan),
                                              "--backend", "numpy"]))
    assert "host 2.00 GiB (not 3.00 GiB)" in err
    err = _one_line_refusal(capsys, demo_main(["2", "1", "128", "tiny", "--plan", str(plan),
                                              "--rounds", "2", "--backend", "numpy"]))
    assert "--rounds" in err
    (tmp_path / "bad.json").write_text("{not json")
    err = _one_line_refusal(capsys, demo_main(["2", "1", "128", "tiny", "--plan",
                                              str(tmp_path / "bad.json")]))
    assert "is not a plan file" in err


def test_demo_backend_cupy_without_a_gpu_is_bad_input(capsys):
    """--backend cupy on a machine without a usable GPU exits 2 and suggests numpy."""
    from dataflow.backends import make_backend

    if make_backend("auto").name == "cupy":
        pytest.skip("a GPU is usable here")
    err = _one_line_refusal(capsys, demo_main(["2", "0.25", "256", "tiny", "--backend", "cupy"]))
    assert "numpy" in err


def test_demo_refuses_budgets_above_available_memory_naming_both(capsys, monkeypatch):
    """Budgets above psutil's available memory are refused before any allocation, with both
    numbers (NumPy: host and device slabs both live in host memory)."""
    import psutil

    _refuse_engine(monkeypatch)
    real = psutil.virtual_memory()
    fake = real._replace(available=2 * 2**30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    err = _one_line_refusal(capsys, demo_main(["2", "0.25", "256", "tiny", "--backend",
                                              "numpy"]))
    assert "2.25 GiB" in err and "2.00 GiB" in err and "available" in err
    assert "DATAFLOW_HOST_CHECK=off" in err


def test_host_check_off_lets_budgets_above_available_memory_through(monkeypatch):
    """DATAFLOW_HOST_CHECK=off: a machine whose memory grows as it is used is not refused (the
    engine is reached; here a sentinel stands in for it)."""
    import psutil

    from dataflow.engine import Engine

    reached = []

    def sentinel(*a, **k):
        reached.append(True)
        raise RuntimeError("sentinel: the engine was reached")

    monkeypatch.setattr(Engine, "from_plan", classmethod(sentinel))
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2 * 2**30))
    monkeypatch.setenv("DATAFLOW_HOST_CHECK", "off")
    try:
        demo_main(["2", "0.25", "256", "tiny", "--backend", "numpy"])
    except BaseException:  # noqa: BLE001 - the sentinel, however the demo reports it
        pass
    assert reached


def test_size_text_uses_mib_below_one_gib():
    """Budgets in messages: MiB below 1 GiB, GiB from there."""
    assert demo_checks.size_text(20 * 2**20 + 2**19) == "20.5 MiB"
    assert demo_checks.size_text(24 * 2**30) == "24.00 GiB"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_stops_on_nan_with_exit_3_and_marks_the_metrics_row(capsys, tmp_path):
    """--lr 1e9: 'loss became NaN at step N (lr ...); lower --lr', exit 3, the bad step's row
    in the metrics (loss NaN) and the run's status; --json still one valid document."""
    import math

    from dataflow.metrics_log import read_metrics, read_run_metadata

    m = tmp_path / "m.csv"
    code = demo_main([*FAST, "--backend", "numpy", "--lr", "1e9", "--steps", "6", "--warmup", "0",
                      "--metrics", str(m), "--json"])
    out, err = capsys.readouterr()
    assert code == demo_checks.EXIT_NONFINITE, err
    last = err.strip().splitlines()[-1]
    assert "became" in last and "(lr " in last and last.endswith("); lower --lr")
    assert "Traceback" not in err
    step = int(last.split(" at step ")[1].split()[0])
    doc = json.loads(out)
    assert doc["status"].startswith("nonfinite") and len(doc["steps"]) == step - 1
    table = read_metrics(m)
    losses = table.column("loss").to_pylist()
    assert len(losses) == step and all(math.isfinite(x) for x in losses[:-1])
    assert not math.isfinite(losses[-1])
    assert read_run_metadata(m)[-1]["status"] == f"nonfinite loss at step {step}"


def _run_and_signal(tmp_path, signals, *extra):
    """Start the demo in a subprocess, send `signals` once its first step line is out, and
    return (exit code, stderr)."""
    cmd = [sys.executable, "-m", "dataflow.cli.demo", *FAST, "--backend", "numpy", "--steps", "200",
           "--trace", str(tmp_path / "t.json"), "--metrics", str(tmp_path / "m.parquet"),
           "--json", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "out.json", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True,
                                env=env)
        lines = []
        deadline = time.monotonic() + 120
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("step 1:"):
                break
            assert time.monotonic() < deadline, "".join(lines)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.05)
        _, rest = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + rest


@pytest.mark.parametrize("signals,code", [((signal.SIGINT,), 130), ((signal.SIGTERM,), 143),
                                          ((signal.SIGINT, signal.SIGINT), 130)],
                         ids=["sigint", "sigterm", "sigint-twice"])
def test_demo_stops_cleanly_on_a_signal(tmp_path, signals, code):
    """After the first step line: one 'interrupted at step N' line (or, when a second signal
    abandons step N + 1, 'interrupted in step N + 1 (...; N step(s) finished)'), exit 130/143,
    no traceback, and --json, the trace and the metrics all closed, valid, agreeing on N steps
    and telling the same story as stderr's last line."""
    from dataflow.metrics_log import read_metrics, read_run_metadata

    rc, err = _run_and_signal(tmp_path, signals)
    assert rc == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    doc = json.loads((tmp_path / "out.json").read_text())
    n = len(doc["steps"])
    assert 1 <= n < 200
    assert doc["status"] in (f"interrupted at step {n}", f"interrupted in step {n + 1}"), doc
    assert last.startswith(f"dataflow-demo: {doc['status']}"), (last, doc["status"])
    if "in step" in doc["status"]:
        assert f"{n} step(s) finished" in last, last
    trace = json.loads((tmp_path / "t.json").read_text())
    steps = {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == set(range(1, n + 1))
    assert read_metrics(tmp_path / "m.parquet").num_rows == n
    assert read_run_metadata(tmp_path / "m.parquet")[-1]["status"].startswith("interrupted")


@pytest.mark.parametrize("main", [demo_main, plan_main], ids=["demo", "plan"])
def test_finite_budget_too_large_for_bytes_is_refused_by_name(capsys, main):
    """1.67e299 GiB is finite but overflows to infinite bytes (the fuzz test found
    dataflow-plan's OverflowError): exit 2 naming the budget and the 1 PiB limit."""
    try:
        code = main(["0.25", "1.6742321987285427e+299", "64", "tiny", "--backend", "numpy"]
                    if main is demo_main else ["0.25", "1.6742321987285427e+299", "64", "tiny"])
    except SystemExit as exc:
        code = exc.code
    err = _one_line_refusal(capsys, code)
    assert "device budget 1.67423e+299 GiB" in err and "1 PiB" in err


def test_a_misspelt_flag_is_refused_with_the_flag_it_was_meant_to_be(capsys):
    """`--stpes 2` exits 2 with one line that names --steps; an unlike word gets no guess."""
    from dataflow.cli.demo import main as demo_main

    assert demo_main(["2", "0.25", "64", "tiny", "--stpes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean --steps for --stpes?" in err[0], err
    assert demo_main(["2", "0.25", "64", "tiny", "--zzz", "2"]) == 2
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("cli", ["demo", "plan", "sweep", "ring", "probe", "data", "export"])
def test_every_cli_takes_flags_only_as_spelled_in_full(cli):
    """argparse's prefix matching is off (args.OneLineParser): a shortened flag such as
    --eval-seq is not taken for --eval-seqs, so a flag added later cannot change what a script's
    abbreviation means; the demo's refusal names the full flag."""
    import importlib

    parser = importlib.import_module(f"dataflow.cli.{cli}").build_parser()
    assert parser.allow_abbrev is False


def test_a_shortened_flag_is_refused_with_its_full_spelling(capsys):
    from dataflow.cli.demo import main as demo_main

    assert demo_main(["2", "0.25", "64", "tiny", "--eval-seq", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean --eval-seqs for --eval-seq?" in err[0], err
