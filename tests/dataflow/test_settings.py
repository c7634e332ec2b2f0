"""dataflow.settings: every DATAFLOW_* variable is a documented field of one frozen Settings,
parsed with the defaults its readers always used, and nothing else in the library reads one."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dataflow.settings import Settings, settings_from_env

ROOT = Path(__file__).resolve().parents[2]
_READ = re.compile(r"""environ\.get\(\s*["']DATAFLOW_|getenv\(\s*["']DATAFLOW_"""
                   r"""|environ\[\s*["']DATAFLOW_[A-Z0-9_]+["']\s*\](?!\s*=)""")


def _variables() -> set[str]:
    source = (ROOT / "dataflow" / "settings.py").read_text()
    return set(re.findall(r'"(DATAFLOW_[A-Z0-9_]+)"', source))


def test_an_empty_environment_gives_the_defaults():
    """Unset and empty variables are the dataclass defaults; Settings is frozen."""
    assert settings_from_env({}) == Settings()
    assert settings_from_env({name: "" for name in _variables()}) == Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings_from_env({}).pin = "alloc"


def test_each_variable_reaches_its_field_as_its_reader_parsed_it():
    """The values the readers used to take from os.environ, field by field."""
    s = settings_from_env({
        "DATAFLOW_ALLOC_GUARD": "WARN", "DATAFLOW_COMMIT": "abc", "DATAFLOW_CUDNN_CACHE_DIR": "off",
        "DATAFLOW_HOST_CHECK": " Off ", "DATAFLOW_PIN": "alloc", "DATAFLOW_PIN_PIECES": "2",
        "DATAFLOW_PREBUILD": "0", "DATAFLOW_RING_DEBUG": "1", "DATAFLOW_RING_ID": "job7",
        "DATAFLOW_RING_PORT": "29600", "DATAFLOW_RUN_AHEAD_OPS": " 64 ",
        "DATAFLOW_MOE_EXPERTS": " Loop ", "DATAFLOW_FP8_SCALES": "Guessed"})
    assert s == Settings(alloc_guard="WARN", commit="abc", cudnn_cache_dir="off", host_check=False,
                         pin="alloc", pin_pieces="2", prebuild=False, ring_debug=True,
                         ring_id="job7", ring_port="29600", run_ahead_ops="64",
                         moe_experts="loop", fp8_scales="guessed")
    assert settings_from_env({"DATAFLOW_PREBUILD": "1", "DATAFLOW_HOST_CHECK": "on"}).prebuild
    assert settings_from_env({"DATAFLOW_HOST_CHECK": "on"}).host_check


def test_every_variable_has_a_field_a_docstring_and_a_row_in_docs():
    """One field per variable, its docstring naming it, and docs/settings.md listing it."""
    variables = _variables()
    assert len(variables) == len(dataclasses.fields(Settings)) == 13
    source = (ROOT / "dataflow" / "settings.py").read_text()
    doc = (ROOT / "docs" / "settings.md").read_text()
    for name in variables:
        assert f'"""{name}:' in source, name
        assert f"| `{name}` |" in doc, name


def test_no_module_but_settings_reads_a_dataflow_variable():
    """Library, ring and benchmark code read DATAFLOW_* through settings_from_env only
    (setting one for a child process is fine)."""
    bad = []
    for package in ("dataflow", "kernels", "memplan", "models", "ring", "bench"):
        for f in sorted((ROOT / package).rglob("*.py")):
            if "records" in f.parts or f == ROOT / "dataflow" / "settings.py":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if _READ.search(line):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
