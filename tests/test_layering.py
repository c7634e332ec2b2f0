"""Every arrow of the architecture (DESIGN.md §3): models <- memplan <- dataflow <- ring, bench;
kernels is used by dataflow (and bench's kernel benchmarks) only and depends on none of ours;
the planner stays pure Python; nobody imports another package's private modules or names."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"models", "memplan", "kernels", "dataflow", "ring", "bench"}
MAY_IMPORT = {
    "models": set(),
    "kernels": set(),
    "memplan": {"models"},
    "dataflow": {"models", "memplan", "kernels"},
    "ring": {"models", "memplan", "kernels", "dataflow"},
    "bench": {"models", "memplan", "kernels", "dataflow", "ring"},
}
ARRAY_LIBS = {"numpy", "cupy", "cupyx", "ml_dtypes", "numba", "torch", "jax"}


def _layer(module: str) -> str:
    """The architecture's package of a dotted import: `dataflow.memplan.search.cost` -> memplan,
    `dataflow.engine` -> dataflow; a bare `memplan...` keeps its name (and is refused below)."""
    parts = module.split(".")
    if parts[0] == "dataflow" and len(parts) > 1 and parts[1] in OURS - {"dataflow"}:
        return parts[1]
    return parts[0]


def _imports(path: Path):
    """(package, dotted module after the package, imported names) of every absolute import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield _layer(a.name), a.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield _layer(node.module), node.module, tuple(a.name for a in node.names)


def _files(package: str):
    """The package's modules; bench/records/ holds scripts of past runs, kept as they ran."""
    return sorted(p for p in (ROOT / package).rglob("*.py") if "records" not in p.parts)


def test_every_package_imports_only_what_the_architecture_allows():
    bad = []
    for package, allowed in MAY_IMPORT.items():
        for f in _files(package):
            for top, module, _ in _imports(f):
                if top in OURS and top != package and top not in allowed:
                    bad.append(f"{f.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_nobody_imports_private_modules_or_names_of_another_package():
    bad = []
    for package in MAY_IMPORT:
        for f in _files(package):
            for top, module, names in _imports(f):
                if top not in OURS or top == package:
                    continue
                private = [p for p in module.split(".")[2:] if p.startswith("_")]
                private += [n for n in names if n.startswith("_")]
                if private:
                    bad.append(f"{f.relative_to(ROOT)}: {module} {private}")
    assert not bad, "\n".join(bad)


def test_every_import_of_ours_uses_the_installed_dataflow_names():
    """The wheel installs only `dataflow`: `import memplan` works in a checkout but not for a user
    (and would load a second copy of the module beside `dataflow.memplan`)."""
    bad = []
    for f in [p for package in MAY_IMPORT for p in _files(package)] + sorted((ROOT / "tests").rglob("*.py")) \
            + sorted((ROOT / "examples").rglob("*.py")):
        for _, module, _ in _imports(f):
            if module.split(".")[0] in OURS - {"dataflow"}:
                bad.append(f"{f.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_memplan_imports_no_array_gpu_or_downstream_package():
    """Every memplan/*.py imports neither array/GPU libraries nor packages that depend on it."""
    files = _files("memplan")
    assert len(files) >= 10
    bad = {f.name: sorted({top for top, _, _ in _imports(f)} & (ARRAY_LIBS | (OURS - {"models", "memplan"})))
           for f in files}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_importing_the_planner_loads_no_array_library():
    """At run time too: importing memplan (and its CLI) pulls in no numpy or cupy."""
    code = ("import sys, dataflow.memplan, dataflow.memplan.cli, dataflow.memplan.search.sanity, dataflow.memplan.step.compile; "
            "bad = [m for m in ('numpy', 'cupy', 'ml_dtypes', 'numba') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
