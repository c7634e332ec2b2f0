"""dataflow-probe: no GPU means exit 2 with one line; a measurement becomes a profile whose cost
model reproduces the measured rates, round-trips through save_profile/get_profile and is what
the engine then plans with; the table names every quantity. The CPU tests feed made-up
measurements; the GPU test runs --quick for real."""

from __future__ import annotations

import dataclasses
import sys
import time
import types

import pytest

from dataflow.cli import probe as cli
from dataflow.probe.profile import Measurements, build_profile, builtin_profile, format_table
from dataflow.memplan.search.cost import attn_flop_per_s, fp8_gemm_flop_per_s, gemm_flop_per_s
from dataflow.memplan.plan.profiles import BUILTIN_PROFILES, default_cache_path, get_profile, load_profile
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

H100_NAME = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def _private_profile_cache(tmp_path, monkeypatch):
    """A cache of our own: the tests never read or write this machine's real profile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def fake_measurements(rng, name: str = H100_NAME) -> Measurements:
    """Plausible H100-like rates, drawn fresh each time."""
    def u(lo, hi):
        return float(rng.uniform(lo, hi))

    return Measurements(
        device_name=name, device_mem_bytes=int(u(79, 80) * 2**30), pcie_gen=5,
        h2d_bytes_per_s=u(40e9, 57e9), d2h_bytes_per_s=u(40e9, 57e9),
        h2d_duplex_bytes_per_s=u(30e9, 50e9), d2h_duplex_bytes_per_s=u(30e9, 50e9),
        host_copy_bytes_per_s=u(50e9, 150e9), host_adamw_bytes_per_s=u(2e9, 8e9),
        device_mem_bytes_per_s=u(2.5e12, 3.3e12), chunk_tokens=8192,
        split_context_tokens=57344, gemm_burst_flop_per_s=u(740e12, 800e12),
        gemm_flop_per_s=u(600e12, 700e12), attn_fwd_flop_per_s=u(450e12, 600e12),
        attn_bwd_flop_per_s=u(350e12, 500e12), split_attn_fwd_flop_per_s=u(450e12, 650e12),
        split_attn_bwd_flop_per_s=u(350e12, 550e12), attn_path="cudnn", wall_s=u(20, 50))


@pytest.fixture
def fake_gpu(monkeypatch, rng):
    """A GPU that is 'available' and a measure module that returns made-up measurements."""
    m = fake_measurements(rng)
    fake = types.ModuleType("dataflow.probe.measure")
    fake.QUICK, fake.FULL = "quick", "full"
    fake.device_info = lambda: (m.device_name, m.device_mem_bytes, m.pcie_gen)
    fake.calls = []
    fake.measure_all = lambda cfg, settings: fake.calls.append((cfg.name, settings)) or m
    monkeypatch.setitem(sys.modules, "dataflow.probe.measure", fake)
    monkeypatch.setattr("dataflow.backends.cupy_backend.gpu_available", lambda: True)
    return m, fake


def test_probe_exits_2_with_one_line_and_writes_nothing_without_a_gpu(monkeypatch, capsys):
    """No usable GPU: status 2, one line on stderr saying what to do, no profile written."""
    monkeypatch.setattr("dataflow.backends.cupy_backend.gpu_available", lambda: False)
    assert cli.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no NVIDIA GPU" in err and "--gpu" in err
    assert not default_cache_path().exists()


@pytest.mark.parametrize("argv", [["--peak-tflops", "-1"], ["--model", "llama8b"],
                                  ["--frobnicate"], ["--base", "h100", "--base"]])
def test_probe_exits_2_on_bad_flags_with_one_line(argv, capsys):
    """Bad numbers, unknown models and unknown flags are refused before anything is measured."""
    assert cli.main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_probe_help_names_every_flag(capsys):
    """--help exits 0 and documents each option the parser defines."""
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--quick", "--out", "--base", "--peak-tflops", "--debug"):
        assert flag in out


@pytest.mark.parametrize("model", ["8b", "1b", "15b"])
def test_built_profile_makes_the_cost_model_reproduce_the_measured_rates(model, rng):
    """At the measured shapes the planner's GEMM and attention rates equal the measured ones;
    copy and memory rates are taken as measured; the peak and name carry over."""
    cfg, base = load_config(model), BUILTIN_PROFILES["h100"]
    m = fake_measurements(rng)
    prof = build_profile(base, m, cfg)
    t = m.chunk_tokens
    assert gemm_flop_per_s(cfg, prof, t) == pytest.approx(m.gemm_flop_per_s, rel=1e-12)
    assert attn_flop_per_s(cfg, prof, prof.attn_fwd_efficiency, t) == pytest.approx(
        m.attn_fwd_flop_per_s, rel=1e-12)
    assert attn_flop_per_s(cfg, prof, prof.attn_bwd_efficiency, t) == pytest.approx(
        m.attn_bwd_flop_per_s, rel=1e-12)
    assert (prof.h2d_bytes_per_s, prof.d2h_bytes_per_s, prof.h2d_duplex_bytes_per_s,
            prof.d2h_duplex_bytes_per_s, prof.host_mem_bytes_per_s, prof.device_mem_bytes_per_s,
            prof.device_mem_bytes) == (
        m.h2d_bytes_per_s, m.d2h_bytes_per_s, m.h2d_duplex_bytes_per_s,
        m.d2h_duplex_bytes_per_s, m.host_adamw_bytes_per_s, m.device_mem_bytes_per_s,
        m.device_mem_bytes)
    assert (prof.name, prof.peak_bf16_flop_per_s) == (base.name, base.peak_bf16_flop_per_s)


@pytest.mark.parametrize("model", ["8b", "1b"])
def test_a_measured_fp8_rate_is_what_the_cost_model_gives_back(model, rng):
    """The FP8 GEMM rate measured at the layer's shapes is the cost model's FP8 rate there (the
    profile keeps the large-size rate, scaled by size as bf16's); a GPU that measured none
    keeps the base profile's (None on a profile without one: no FP8 speedup claimed)."""
    cfg = load_config(model)
    base = dataclasses.replace(BUILTIN_PROFILES["h100"], fp8_gemm_flop_per_s=None)
    m = fake_measurements(rng)
    m = dataclasses.replace(m, fp8_gemm_flop_per_s=m.gemm_flop_per_s * rng.uniform(1.5, 1.9))
    prof = build_profile(base, m, cfg)
    assert fp8_gemm_flop_per_s(cfg, prof, m.chunk_tokens) == pytest.approx(
        m.fp8_gemm_flop_per_s, rel=1e-12)
    assert "FP8 GEMM" in format_table(base, prof, m, cfg)
    unmeasured = build_profile(BUILTIN_PROFILES["h200"], dataclasses.replace(
        m, fp8_gemm_flop_per_s=None), cfg)
    assert unmeasured.fp8_gemm_flop_per_s == BUILTIN_PROFILES["h200"].fp8_gemm_flop_per_s
    assert build_profile(base, dataclasses.replace(m, fp8_gemm_flop_per_s=None),
                         cfg).fp8_gemm_flop_per_s is None
    assert "not measured" in format_table(base, build_profile(base, dataclasses.replace(
        m, fp8_gemm_flop_per_s=None), cfg), dataclasses.replace(m, fp8_gemm_flop_per_s=None),
        cfg)


def test_unmeasured_fields_carry_over_from_the_base_profile(rng):
    """Every field the probe does not measure is the base profile's (so fields added to
    HardwareProfile later survive a probe run); --peak-tflops replaces only the peak."""
    base, m = BUILTIN_PROFILES["h100"], fake_measurements(rng)
    m = dataclasses.replace(m, pcie_gen=None)
    prof = build_profile(base, m, load_config("8b"), peak_flop_per_s=900e12)
    measured = {"gemm_efficiency", "attn_fwd_efficiency", "attn_bwd_efficiency",
                "h2d_bytes_per_s", "d2h_bytes_per_s", "h2d_duplex_bytes_per_s",
                "d2h_duplex_bytes_per_s", "host_mem_bytes_per_s", "device_mem_bytes_per_s",
                "device_mem_bytes", "peak_bf16_flop_per_s", "fp8_gemm_flop_per_s"}
    for f in dataclasses.fields(base):
        if f.name not in measured:
            assert getattr(prof, f.name) == getattr(base, f.name), f.name
    assert prof.peak_bf16_flop_per_s == 900e12


def test_rates_above_the_peak_are_capped_and_flagged(rng):
    """A rate over the peak (a wrong --peak-tflops) keeps the profile valid and says so."""
    cfg, base = load_config("8b"), BUILTIN_PROFILES["a100"]
    m = fake_measurements(rng)
    prof = build_profile(base, m, cfg)
    assert prof.gemm_efficiency == 1.0
    assert "capped" in format_table(base, prof, m, cfg)


def test_measured_profile_round_trips_through_get_profile(tmp_path, rng):
    """save_profile then get_profile of the same GPU name gives the measured profile back;
    another GPU's name still gets its built-in."""
    cfg, base = load_config("8b"), BUILTIN_PROFILES["h100"]
    prof = build_profile(base, fake_measurements(rng), cfg)
    path = tmp_path / "profile.json"
    from dataflow.memplan.plan.profiles import save_profile

    save_profile(prof, path)
    assert load_profile(path) == prof
    assert get_profile("H100 SXM", cache_path=path) == prof
    assert get_profile("a100", cache_path=path) == BUILTIN_PROFILES["a100"]


def test_probe_writes_the_cache_the_planner_and_engine_read(fake_gpu, capsys):
    """End to end with a fake measurement: --quick writes the default cache, prints the table,
    and get_profile and the engine's default profile for this GPU both return it."""
    m, fake = fake_gpu
    assert cli.main(["--quick", "--model", "1b"]) == 0
    assert fake.calls == [("1b", "quick")]
    out = capsys.readouterr().out
    for label in ("h2d alone", "d2h duplex", "host memory", "device memory", "GEMM efficiency",
                  "attention fwd", "attention bwd", "split-sequence attention bwd", "PCIe"):
        assert label in out, label
    written = load_profile(default_cache_path())
    assert written == build_profile(BUILTIN_PROFILES["h100"], m, load_config("1b"))
    assert get_profile("h100") == written
    from dataflow.engine import default_profile

    be = types.SimpleNamespace(name="cupy", device_name=H100_NAME)
    assert default_profile(be) == written


def test_probe_out_writes_elsewhere_and_leaves_the_cache_alone(fake_gpu, tmp_path, capsys):
    """--out FILE writes there (for dataflow-plan --profile FILE) and not the cache."""
    out = tmp_path / "elsewhere" / "p.json"
    assert cli.main(["--out", str(out), "--base", "h200"]) == 0
    assert load_profile(out).name == "h200"
    assert not default_cache_path().exists()
    assert f"--profile {out}" in capsys.readouterr().out


def test_unknown_gpu_needs_base_and_says_so(fake_gpu, monkeypatch, capsys):
    """A GPU with no built-in profile: exit 2 naming --base before anything is measured."""
    _, fake = fake_gpu
    monkeypatch.setattr(fake, "device_info", lambda: ("NVIDIA L40S", 48 << 30, 4))
    assert cli.main(["--quick"]) == 2
    assert "--base" in capsys.readouterr().err and fake.calls == []
    with pytest.raises(ConfigError):
        builtin_profile("NVIDIA L40S")
    assert builtin_profile("NVIDIA L40S", "a100") == BUILTIN_PROFILES["a100"]
    assert builtin_profile(H100_NAME) == BUILTIN_PROFILES["h100"]
    assert builtin_profile("NVIDIA H200") == BUILTIN_PROFILES["h200"]
    assert builtin_profile("NVIDIA GeForce RTX 4090") == BUILTIN_PROFILES["rtx4090"]


@pytest.mark.gpu
def test_probe_quick_measures_this_gpu_within_a_minute(tmp_path, capsys):
    """On the GPU: --quick finishes in under 60 s, writes a valid profile that get_profile picks
    up for this GPU, with rates in a sane range (not asserting a particular GPU's numbers)."""
    from tests.gpu import require_gpu

    require_gpu()
    t0 = time.perf_counter()
    assert cli.main(["--quick"]) == 0
    wall = time.perf_counter() - t0
    print(capsys.readouterr().out)
    prof = load_profile(default_cache_path())
    from dataflow.probe.measure import device_info

    name = device_info()[0]
    assert get_profile(builtin_profile(name).name) == prof
    assert 1e9 < prof.h2d_bytes_per_s < 1e12 and 1e9 < prof.d2h_bytes_per_s < 1e12
    assert prof.h2d_duplex_bytes_per_s <= 1.1 * prof.h2d_bytes_per_s
    assert 1e11 < prof.device_mem_bytes_per_s < 2e13
    assert 0.2 < prof.gemm_efficiency <= 1 and 0.1 < prof.attn_fwd_efficiency <= 1
    assert 0.1 < prof.attn_bwd_efficiency <= 1
    assert wall < 60, f"--quick took {wall:.0f} s"
    import cupy as cp  # on the GPU only

    if int(cp.cuda.Device().compute_capability) >= 89:  # FP8 measured, at least bf16's rate
        assert prof.fp8_gemm_flop_per_s > prof.peak_bf16_flop_per_s * prof.gemm_efficiency
