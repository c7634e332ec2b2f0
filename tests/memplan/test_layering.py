"""The planner stays pure Python: no module of memplan imports array or GPU libraries."""

import ast
from pathlib import Path

import memplan

FORBIDDEN = {"numpy", "cupy", "cupyx", "ml_dtypes", "numba", "torch", "jax", "dataflow", "kernels",
             "ring", "bench"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_memplan_imports_no_array_gpu_or_downstream_package():
    """Every memplan/*.py imports neither array/GPU libraries nor packages that depend on it."""
    files = sorted(Path(memplan.__file__).parent.glob("*.py"))
    assert len(files) >= 10
    bad = {f.name: sorted(_imports(f) & FORBIDDEN) for f in files}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_importing_the_planner_loads_no_array_library():
    """At run time too: importing memplan (and its CLI) pulls in no numpy or cupy."""
    import subprocess
    import sys

    code = ("import sys, memplan, memplan.cli, memplan.sanity; "
            "bad = [m for m in ('numpy', 'cupy', 'ml_dtypes', 'numba') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
