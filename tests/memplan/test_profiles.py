"""Built-in hardware profiles, lookup by name, JSON round-trip and the cached measured profile."""

import dataclasses

import pytest

from dataflow.memplan.plan.profiles import (
    BUILTIN_PROFILES,
    default_cache_path,
    get_profile,
    known_profiles,
    load_profile,
    save_profile,
)
from dataflow.models.errors import ConfigError


def test_builtin_profiles_cover_the_issue_gpus_with_datasheet_peaks():
    """H100, H200, A100, RTX 4090/5090/3090 exist with the datasheet dense bf16 peaks."""
    peaks = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "rtx4090": 165e12,
             "rtx5090": 209.5e12, "rtx3090": 71e12}
    for name, peak in peaks.items():
        assert get_profile(name).peak_bf16_flop_per_s == peak
    h100 = get_profile("h100")
    assert h100.h2d_bytes_per_s == 55e9 and h100.h2d_duplex_bytes_per_s == 47e9
    assert h100.gemm_efficiency == pytest.approx(680 / 989, abs=0.01)  # sustained, not burst


@pytest.mark.parametrize("alias", ["H100 SXM", "h100-sxm", "NVIDIA H100", "A100 80GB", "4090"])
def test_profile_lookup_accepts_spelled_out_names(alias):
    """Case, spaces, dashes and an 'NVIDIA' prefix do not matter."""
    assert get_profile(alias).name in known_profiles()


def test_unknown_gpu_error_lists_known_names():
    """An unknown GPU name is a ConfigError naming every known profile."""
    with pytest.raises(ConfigError) as exc:
        get_profile("v100")
    for name in BUILTIN_PROFILES:
        assert name in str(exc.value)


def test_profile_json_round_trip(tmp_path):
    """save_profile then load_profile returns an equal profile."""
    p = dataclasses.replace(get_profile("a100"), h2d_bytes_per_s=23.5e9)
    assert load_profile(save_profile(p, tmp_path / "p.json")) == p


def test_cached_measured_profile_overrides_the_default_of_its_name(tmp_path):
    """A cached profile with the same name replaces the built-in; another name does not."""
    cache = tmp_path / "profile.json"
    measured = dataclasses.replace(get_profile("h100"), h2d_bytes_per_s=51e9)
    save_profile(measured, cache)
    assert get_profile("h100", cache_path=cache) == measured
    assert get_profile("a100", cache_path=cache) == BUILTIN_PROFILES["a100"]


def test_default_cache_path_follows_xdg(tmp_path):
    """The probe's cache lives under $XDG_CACHE_HOME/dataflow/."""
    path = default_cache_path({"XDG_CACHE_HOME": str(tmp_path)})
    assert path == tmp_path / "dataflow" / "profile.json"
    save_profile(dataclasses.replace(get_profile("h100"), d2h_bytes_per_s=40e9), path)
    assert get_profile("h100", cache_path=path).d2h_bytes_per_s == 40e9


def test_broken_cache_falls_back_to_defaults(tmp_path):
    """A corrupt cache file never stops planning."""
    cache = tmp_path / "profile.json"
    cache.write_text("{not json")
    assert get_profile("h100", cache_path=cache) == BUILTIN_PROFILES["h100"]


def test_profile_with_bad_rate_is_refused(tmp_path):
    """Non-positive rates and efficiencies above 1 are ConfigErrors that name the field."""
    with pytest.raises(ConfigError, match="gemm_efficiency"):
        save_profile(dataclasses.replace(get_profile("h100"), gemm_efficiency=1.5),
                     tmp_path / "x.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
