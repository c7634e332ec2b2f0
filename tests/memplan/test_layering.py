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
