"""Every kernel the CUDA op table and the CuPy backend call as `K.<name>` is exported by
dataflow.kernels.cuda, checked from the sources (CI has no CuPy to import them): a missing export
otherwise shows only on a GPU, at the first call."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _exports() -> set[str]:
    tree = ast.parse((ROOT / "kernels" / "cuda" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("kernels/cuda/__init__.py has no __all__")


def _uses(path: pathlib.Path) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "K"}


def test_every_kernel_called_through_K_is_exported():
    exported = _exports()
    for rel in ("dataflow/ops_cuda.py", "dataflow/ops_cuda_moe.py",
                "dataflow/backends/cupy_backend.py"):
        used = _uses(ROOT / rel)
        assert used, rel
        assert used <= exported, (rel, sorted(used - exported))


def _bound_kernels() -> set[str]:
    """The kernel names CudaOps binds to its CudaContext (ops_cuda._BOUND, ops_cuda_moe.MOE_BOUND),
    read from the sources: the op names of the first, the values of the second."""
    names = set()
    for rel, var in (("dataflow/ops_cuda.py", "_BOUND"), ("dataflow/ops_cuda_moe.py", "MOE_BOUND")):
        for node in ast.parse((ROOT / rel).read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == var
                                                    for t in node.targets):
                names |= {c.value for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def test_every_kernel_the_op_table_binds_is_exported():
    """CudaOps binds these by name (getattr on dataflow.kernels.cuda): each must be exported."""
    bound = _bound_kernels()
    assert {"rms_norm_fwd", "cast", "permute_fwd", "unpermute_bwd"} <= bound
    bound -= {"moe_permute", "moe_combine_bwd"}  # MOE_BOUND's keys: op names, not kernels
    assert bound <= _exports(), sorted(bound - _exports())
