"""bench/budget_truth.py on the CPU: two tiny cells run in fresh demo processes and leave one
strict JSON record each (budgets, plan totals, sampled RSS, overshoot, tok/s, init time); an
infeasible cell is recorded without a process; bad cells are refused with exit 2; the sampler
reports clock, power and power cap over busy NVML samples only (a scripted NVML)."""

from __future__ import annotations

import json
import types

import pytest

from dataflow.bench.budget_truth import BudgetRecord, main, parse_cell
from dataflow.models.errors import ConfigError
from dataflow.models.serial import from_dict


def _record(out, slug) -> BudgetRecord:
    return from_dict(BudgetRecord, json.loads((out / f"{slug}.json").read_text()))


def test_two_tiny_cells_run_in_fresh_processes_and_write_their_records(tmp_path, rng):
    """Each record is readable by the strict loader, says ok, echoes its budgets, holds the
    plan's totals and hash, a sampled RSS peak, the overshoot computed from it, and tok/s and
    init time parsed from the demo's own output."""
    host = float(rng.choice([1.5, 2.0]))
    cells = [f"tiny:128:{host:g}:0.25", "tiny:256:1:0.25"]
    assert main(["--out", str(tmp_path), "--backend", "numpy", "--steps", "2", *cells]) == 0
    for text, slug in zip(cells, [f"tiny-s128-h{host:g}-d0.25", "tiny-s256-h1-d0.25"]):
        r = _record(tmp_path, slug)
        cell = parse_cell(text)
        assert r.status == "ok" and r.exit_code == 0 and r.error is None, r
        assert r.attention_bwd == "deterministic"
        assert (r.model, r.seqlen, r.host_gib, r.dev_gib) == cell.key
        assert r.host_budget_bytes == int(cell.host_gib * 2**30)
        assert r.device_budget_bytes == 2**28
        plan = json.loads((tmp_path / f"{slug}.plan.json").read_text())
        assert r.plan_hash and r.plan_hash in (tmp_path / f"{slug}.demo.json").read_text()
        assert plan["model"]["name"] == "tiny"
        assert 0 < r.planned_device_bytes <= r.device_budget_bytes
        assert 0 < r.planned_host_bytes <= r.host_budget_bytes
        assert r.peak_rss_bytes > 20 * 2**20  # a Python with NumPy, sampled while it ran
        assert r.host_overshoot_bytes == r.peak_rss_bytes - r.host_budget_bytes \
            - r.device_budget_bytes  # NumPy: the device arena is host memory too
        assert r.peak_device_used_bytes is None and r.device_overshoot_bytes is None  # no NVML
        assert r.libraries_and_pool_bytes is None  # the NumPy backend has no device libraries
        assert r.tok_per_s > 0 and r.predicted_tok_per_s > 0 and r.steps_averaged == 1
        assert 0 < r.init_s < r.wall_s
        assert (tmp_path / r.log).read_text().count("step 2:") >= 1


def test_fast_attention_plans_the_cell_with_the_atomic_backward(tmp_path):
    """--fast-attention reaches the demo through the plan file and is recorded; so does
    --rounds: the cell is planned at those rounds and its record says so."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", "--steps", "1",
                 "--fast-attention", "--rounds", "3", "tiny:256:1:0.25"]) == 0
    r = _record(tmp_path, "tiny-s256-h1-d0.25")
    assert r.status == "ok" and r.attention_bwd == "fast" and r.rounds_per_step == 3, r
    plan = json.loads((tmp_path / "tiny-s256-h1-d0.25.plan.json").read_text())
    assert plan["attention_bwd"] == "fast" and plan["chunking"]["rounds_per_step"] == 3
    assert r.plan_hash in (tmp_path / "tiny-s256-h1-d0.25.demo.json").read_text()


def test_infeasible_cell_is_recorded_without_a_process(tmp_path):
    """Budgets the planner refuses give an 'infeasible' record with the planner's reason."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", "tiny:256:0.01:0.01"]) == 0
    r = _record(tmp_path, "tiny-s256-h0.01-d0.01")
    assert r.status == "infeasible" and "does not fit" in r.error
    assert r.exit_code is None and r.peak_rss_bytes is None
    assert not (tmp_path / "tiny-s256-h0.01-d0.01.log").exists()


@pytest.mark.parametrize("argv, message", [
    (["tiny:256:2"], "MODEL:SEQLEN:HOST_GB:DEV_GB"),
    (["tiny:lots:2:1"], "whole number"),
    (["tiny:256:-1:1"], "positive"),
    (["llama8b:256:2:1"], "llama8b"),
    (["--steps", "0", "tiny:256:2:1"], "--steps 0"),
    (["--rounds", "0", "tiny:256:2:1"], "--rounds 0"),
])
def test_bad_cells_and_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    """Refusals name the bad text and happen before any cell runs."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))


def test_parse_cell_reads_the_issue_notation():
    cell = parse_cell("8b:65536:120:24")
    assert cell.key == ("8b", 65536, 120.0, 24.0)
    with pytest.raises(ConfigError, match="e.g. '8b:65536:120:24'"):
        parse_cell(":1:2:3")


class _FakeNvml:
    """What dataflow.bench.sweep.monitor reads from pynvml, scripted: busy at 1,600 MHz and 690 W with the
    power cap on in two samples of three, then idle."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.util = [90, 95, 99, 10]
        self.reasons = [0x4, 0x0, 0x4, 0x0]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self.util[0])

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert which == self.NVML_CLOCK_SM
        return 1600

    def nvmlDeviceGetPowerUsage(self, handle):
        return 690_000  # mW

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self.reasons[0]

    def step(self):
        self.util, self.reasons = self.util[1:], self.reasons[1:]


def test_sampler_reports_clock_power_and_power_cap_over_busy_samples_only():
    from dataflow.bench.sweep import monitor

    fake = _FakeNvml()
    nv = monitor._Nvml.__new__(monitor._Nvml)
    nv.nvml, nv.handle = fake, object()
    got = []
    for _ in range(4):
        got.append(nv.clocks())
        fake.step()
    assert got[:3] == [(1600, 690.0, True), (1600, 690.0, False), (1600, 690.0, True)]
    assert got[3] is None  # idle: not counted
    sampler = monitor.PeakSampler(None)
    sampler._clocks = [c for c in got if c is not None]
    sampler.nvml = types.SimpleNamespace(idle=0)
    sampler._proc_dev = 1
    peaks = sampler.peaks()
    assert peaks.busy_samples == 3 and peaks.sm_clock_mhz_mean == 1600
    assert peaks.power_w_mean == 690.0 and abs(peaks.power_capped_frac - 2 / 3) < 1e-12


def test_sampler_gives_none_when_nvml_cannot_say():
    from dataflow.bench.sweep import monitor

    fake = _FakeNvml()

    def refuse(handle):
        raise fake.NVMLError("not supported")

    fake.nvmlDeviceGetPowerUsage = refuse
    nv = monitor._Nvml.__new__(monitor._Nvml)
    nv.nvml, nv.handle = fake, object()
    assert nv.clocks() is None
    fake.nvmlDeviceGetPowerUsage = lambda handle: 690_000
    assert nv.clocks() is None  # asked once, then not again: the memory samples go on


def test_precision_fp8_plans_and_runs_the_cell_in_fp8(tmp_path):
    """--precision reaches the demo through the plan file (the NumPy backend runs the FP8
    recipe's reference) and the record says it."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", "--steps", "1",
                 "--precision", "fp8", "tiny:256:1:0.25"]) == 0
    r = _record(tmp_path, "tiny-s256-h1-d0.25")
    assert r.status == "ok" and r.precision == "fp8", r
    assert json.loads((tmp_path / "tiny-s256-h1-d0.25.plan.json").read_text())["precision"] \
        == "fp8"
    assert json.loads((tmp_path / "tiny-s256-h1-d0.25.demo.json").read_text())["precision"] \
        == "fp8"


def test_lora_flags_plan_and_train_the_cell_with_adapters(tmp_path):
    """--lora-rank reaches the demo through the plan file and the record says it."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", "--steps", "1",
                 "--lora-rank", "4", "--lora-targets", "q,v", "tiny:256:1:0.25"]) == 0
    r = _record(tmp_path, "tiny-s256-h1-d0.25")
    assert r.status == "ok" and r.lora is not None and "4" in r.lora, r
    assert json.loads((tmp_path / "tiny-s256-h1-d0.25.plan.json").read_text())["lora"]["rank"] \
        == 4
    with pytest.raises(SystemExit) as bad:  # argparse refuses a bad rank, naming it
        main(["--out", str(tmp_path), "--lora-rank", "0", "tiny:256:1:0.25"])
    assert bad.value.code == 2


def test_lora_base_fp8_reaches_the_demo_through_the_plan_file(tmp_path):
    """--lora-base fp8: the cell's plan file stores the base in fp8, its demo trains it, the
    record's lora says base='fp8'."""
    assert main(["--out", str(tmp_path), "--backend", "numpy", "--steps", "1",
                 "--lora-rank", "4", "--lora-base", "fp8", "tiny:256:1:0.25"]) == 0
    r = _record(tmp_path, "tiny-s256-h1-d0.25")
    assert r.status == "ok" and "base='fp8'" in r.lora, r
    assert json.loads((tmp_path / "tiny-s256-h1-d0.25.plan.json").read_text())["lora"]["base"] \
        == "fp8"
