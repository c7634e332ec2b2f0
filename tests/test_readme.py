"""The README says only what the code does: its library example runs, every console script it
names exists, and every flag it gives a command is in that command's --help."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COMMANDS = {"dataflow-demo": "dataflow.cli.demo", "dataflow-plan": "dataflow.cli.plan",
            "dataflow-sweep": "dataflow.cli.sweep", "dataflow-ring": "dataflow.cli.ring",
            "dataflow-export": "dataflow.cli.export", "dataflow-probe": "dataflow.cli.probe",
            "dataflow-data": "dataflow.cli.data"}


def _python_blocks() -> list[str]:
    """The README's Python examples, dedented (one sits inside a numbered list)."""
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)^\s*```", README,
                                                   flags=re.S | re.M)]


def _help(command: str, *sub: str) -> str:
    res = subprocess.run([sys.executable, "-m", COMMANDS[command], *sub, "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


FLAG = r"(?<![\w-])(--[a-z][a-z0-9-]*)"
SUBCOMMANDS = ("run", "plot")


def _sub(rest: str) -> tuple[str, ...]:
    words = rest.split()
    return (words[0],) if words and words[0] in SUBCOMMANDS else ()


def _uses():
    """(command, subcommand..., flags) of each place the README gives a command flags: a
    backticked command line, and a list item of "The commands" (its whole text)."""
    for m in re.finditer(r"`(dataflow-[a-z]+)((?: [^`]*)?)`", README):
        yield m.group(1), _sub(m.group(2)), set(re.findall(FLAG, m.group(2)))
    for m in re.finditer(r"^- `(dataflow-[a-z]+)([^`]*)` — (.*?)(?=^- |^#|\Z)", README,
                         re.M | re.S):
        body = m.group(3).split("`dataflow-")[0]  # another command named in it has its own span
        yield m.group(1), _sub(m.group(2)), set(re.findall(FLAG, body))


def test_readme_names_every_console_script_and_no_other():
    """The README's commands are exactly the ones pyproject.toml installs."""
    scripts = set(re.findall(r"^(dataflow-[a-z]+) = ", (ROOT / "pyproject.toml").read_text(),
                             re.M))
    assert scripts == set(COMMANDS)
    assert set(re.findall(r"\b(dataflow-[a-z]+)\b", README)) == scripts


def test_every_flag_the_readme_gives_a_command_is_in_its_help():
    """Every flag the README gives a command is one that command's --help lists (a renamed or
    dropped flag fails here)."""
    helps: dict[tuple, str] = {}
    bad = []
    for command, sub, flags in _uses():
        key = (command, *sub)
        if key not in helps:
            helps[key] = _help(command, *sub)
        bad += [f"{' '.join(key)} {flag}" for flag in sorted(flags)
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[key])]
    assert len(helps) >= 7
    assert not bad, bad


def test_readme_library_example_trains_on_numpy(tmp_path, monkeypatch):
    """The README's Python example runs as written (NumPy backend, three steps)."""
    blocks = [b for b in _python_blocks() if "from dataflow.engine import Engine" in b]
    assert blocks, "the README lost its library example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "ckpt").is_dir() and (tmp_path / "hf-out" / "config.json").is_file()

