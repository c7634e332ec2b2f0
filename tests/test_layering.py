"""Every arrow of the architecture (DESIGN.md §3): models <- memplan <- dataflow <- ring, bench;
kernels is used by dataflow (and bench's kernel benchmarks) only and depends on none of ours;
the planner stays pure Python; nobody imports another package's private modules or names; the
console scripts (dataflow.cli) may import every package and no package imports them."""

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
CLI = "cli"
"""The layer of dataflow.cli (the folder dataflow/cli/): the console scripts, above every package."""
CLI_DIR = ROOT / "dataflow" / "cli"


def _layer(module: str) -> str:
    """The architecture's package of a dotted import: `dataflow.memplan.search.cost` -> memplan,
    `dataflow.engine` -> dataflow; a bare `memplan...` keeps its name (and is refused below)."""
    parts = module.split(".")
    if parts[0] == "dataflow" and len(parts) > 1 and parts[1] in OURS - {"dataflow"} | {CLI}:
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
    """The package's modules; bench/records/ holds scripts of past runs, kept as they ran; the
    dataflow/ folder's cli/ is the cli layer of its own."""
    if package == CLI:
        return sorted(CLI_DIR.rglob("*.py"))
    return sorted(p for p in (ROOT / package).rglob("*.py")
                  if "records" not in p.parts and CLI_DIR not in p.parents)


def test_every_package_imports_only_what_the_architecture_allows():
    bad = []
    for package, allowed in MAY_IMPORT.items():
        for f in _files(package):
            for top, module, _ in _imports(f):
                if top in OURS and top != package and top not in allowed:
                    bad.append(f"{f.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


MUTABLE_CONSTRUCTORS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict",
                        "Counter", "deque", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
"""Calls that make a mutable container: assigned at module level, they are process-wide state."""
CACHE_DECORATORS = {"cache", "lru_cache"}
HOST_ONLY_CACHES = {"kernels/cuda/rope.py:_plain_param": "host NumPy frequencies per (theta, E)"}
"""functools caches in kernels/ that hold no device object (handles and kernels belong to the
backend's CudaContext), with what they hold."""


def _callee(node: ast.AST) -> str:
    """The last name of a called or decorating expression (`functools.lru_cache(...)` ->
    lru_cache)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def test_kernels_keep_no_module_level_mutable_state():
    """No module of kernels/ assigns a dict, list or set (literal, comprehension or constructor
    call) at module level, nor caches a function with functools but for HOST_ONLY_CACHES: the
    kernels' handles, graphs, compiled modules and scratch live in the backend's CudaContext
    (kernels/cuda/context.py) and are released with it. ALL_CAPS tuples, frozensets and other
    constants, and dunder names (__all__), are fine."""
    containers = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    bad = []
    for f in _files("kernels"):
        rel = f.relative_to(ROOT).as_posix()
        for node in ast.parse(f.read_text(), filename=str(f)).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [ast.unparse(t) for t in targets]
                if all(n.startswith("__") and n.endswith("__") for n in names):
                    continue
                value = node.value
                if isinstance(value, containers) or (isinstance(value, ast.Call)
                                                     and _callee(value) in MUTABLE_CONSTRUCTORS):
                    shown = ast.unparse(value)[:40]
                    bad.append(f"{rel}:{node.lineno} {', '.join(names)} = {shown}")
            elif isinstance(node, ast.FunctionDef):
                cached = any(_callee(d) in CACHE_DECORATORS for d in node.decorator_list)
                if cached and f"{rel}:{node.name}" not in HOST_ONLY_CACHES:
                    bad.append(f"{rel}:{node.lineno} @cache on {node.name}")
    assert not bad, "module-level state in kernels/ (keep it in a CudaContext):\n" + "\n".join(bad)


CLI_IMPORTS_ALLOWED = {
    **{f.relative_to(ROOT).as_posix(): {"dataflow.cli.args"} for f in _files("bench")},
}
"""The only imports of the cli layer from a package: bench's scripts are tools run from the
command line and share its argument checks."""


def test_no_package_imports_the_cli():
    """Product code never depends on the console scripts: no module of models, memplan,
    kernels, dataflow or ring imports dataflow.cli (bench scripts: dataflow.cli.args only)."""
    bad = []
    for package in MAY_IMPORT:
        for f in _files(package):
            allowed = CLI_IMPORTS_ALLOWED.get(f.relative_to(ROOT).as_posix(), set())
            bad += [f"{f.relative_to(ROOT)} imports {module} {names}"
                    for top, module, names in _imports(f)
                    if (top == CLI or (module == "dataflow" and CLI in names))
                    and module not in allowed]
    assert not bad, "\n".join(bad)


def test_the_cli_imports_ours_by_installed_names_and_no_private_names():
    """dataflow/cli/ may import every package, through the installed `dataflow.` names, and
    none of their private modules or names (dunders such as __version__ are public)."""
    files = _files(CLI)
    assert {f.name for f in files} >= {"args.py", "plan.py", "demo.py", "sweep.py", "export.py",
                                       "probe.py"}
    bad = []
    for f in files:
        for top, module, names in _imports(f):
            private = [p for p in (*module.split(".")[2:], *names)
                       if p.startswith("_") and not p.startswith("__")]
            if module.split(".")[0] in OURS - {"dataflow"} or (top in OURS and private):
                bad.append(f"{f.relative_to(ROOT)} imports {module} {private}")
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


def test_the_ring_modules_import_each_other_without_a_circle():
    """dataflow.ring's modules form no import circle (function-local imports included), and no
    ring module holds a command line (dataflow-ring is dataflow/cli/ring.py)."""
    modules = {f.stem: f for f in _files("ring") if f.stem != "__init__"}
    edges = {name: set() for name in modules}
    bad = []
    for name, f in modules.items():
        for _, module, names in _imports(f):
            parts = module.split(".")
            if parts[:2] != ["dataflow", "ring"]:
                continue
            # `from dataflow.ring import x` names the module among the imported names
            targets = parts[2:3] or [n for n in names if n in modules]
            for target in targets:
                if target in modules and target != name:
                    edges[name].add(target)
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            bad.append("import circle: " + " -> ".join(path[path.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(edges[name]):
            visit(target, path + [name])
        done.add(name)

    for name in sorted(modules):
        visit(name, [])
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
    code = ("import sys, dataflow.memplan, dataflow.cli.plan, dataflow.memplan.search.sanity, "
            "dataflow.memplan.step.compile; "
            "bad = [m for m in ('numpy', 'cupy', 'ml_dtypes', 'numba') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


# memplan's three layers
MEMPLAN_LAYERS = ("plan", "step", "search")
"""memplan's layers, each importing only those before it: plan <- step <- search."""
MEMPLAN_EDGE = {"__init__.py"}
"""memplan's modules outside the three layers: the package's re-exports (dataflow-plan, the
planner's command line, is dataflow/cli/plan.py)."""


def _memplan_layer(module: str) -> str | None:
    """The memplan layer of a dotted import (`dataflow.memplan.step.compile` -> step), or None."""
    parts = module.split(".")
    if parts[:2] == ["dataflow", "memplan"] and len(parts) > 2 and parts[2] in MEMPLAN_LAYERS:
        return parts[2]
    return None


def test_every_memplan_module_lives_in_one_of_its_three_layers():
    """memplan/ holds plan/, step/ and search/ and, beside them, only its __init__."""
    loose = sorted(p.name for p in (ROOT / "memplan").glob("*.py") if p.name not in MEMPLAN_EDGE)
    assert not loose, loose
    for layer in MEMPLAN_LAYERS:
        assert len(list((ROOT / "memplan" / layer).glob("*.py"))) >= 4, layer


def test_memplan_layers_import_one_way_plan_step_search():
    """plan imports neither step nor search, step imports plan but not search; no layer imports
    the package itself (its __init__ re-exports search)."""
    bad = []
    for i, layer in enumerate(MEMPLAN_LAYERS):
        allowed = set(MEMPLAN_LAYERS[:i + 1])
        for f in sorted((ROOT / "memplan" / layer).rglob("*.py")):
            for _, module, names in _imports(f):
                dep = _memplan_layer(module)
                if module == "dataflow.memplan":
                    dep = next((n for n in names if n in MEMPLAN_LAYERS), "the package")
                if dep is not None and dep not in allowed:
                    bad.append(f"{f.relative_to(ROOT)} ({layer}) imports {module} {names}")
    assert not bad, "\n".join(bad)


def test_no_function_local_import_of_our_modules_without_a_reason():
    """An import of one of our modules inside a function hides an import circle; every product
    package (dataflow.cli included; bench/records/ and bench/archive/, kept as they ran, aside)
    allows one only with a comment on its line or the line above saying why (an optional
    dependency, say)."""
    bad = []
    files = [f for package in sorted(OURS | {CLI}) for f in _files(package)
             if "archive" not in f.relative_to(ROOT).parts]
    for f in files:
        lines = f.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines), filename=str(f))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    ours = any(_layer(a.name) in OURS | {CLI} for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    ours = node.level > 0 or _layer(node.module or "") in OURS | {CLI}
                else:
                    continue
                above = lines[node.lineno - 2] if node.lineno > 1 else ""
                if ours and "#" not in lines[node.lineno - 1] + above:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "\n".join(bad)


MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120
"""Issue 50's bounds on product code (STYLE.md aims at about 430 lines a file): one job per module
and per function."""


def test_no_product_file_or_function_outgrows_its_bound():
    """No product module (dataflow.cli included; bench/records/ and bench/archive/ aside) is over
    MAX_FILE_LINES lines, and no function or method in one over MAX_FUNCTION_LINES."""
    bad = []
    files = [f for package in sorted(OURS | {CLI}) for f in _files(package)
             if "archive" not in f.relative_to(ROOT).parts]
    for f in files:
        text = f.read_text()
        rel = f.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            bad.append(f"{rel}: {text.count(chr(10))} lines")
        for fn in ast.walk(ast.parse(text, filename=str(f))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = fn.end_lineno - fn.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{rel}:{fn.lineno} {fn.name}: {length} lines")
    assert not bad, "\n".join(bad)
