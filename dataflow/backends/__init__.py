"""Backends implementing dataflow.backend.Backend: NumPy (always; with an optional schedule
sanitizer) and CuPy (NVIDIA GPUs)."""

from __future__ import annotations

from dataflow.backend import BackendError

# The backends are imported inside make_backend: NumPy's loads ml_dtypes (0.6 s), the null one
# the planner, CuPy's CuPy; `dataflow-probe --help` imports this package (via cupy_backend).


def make_backend(kind: str = "auto", **options):
    """'numpy', 'cupy', or 'auto' (CuPy when a GPU is usable, else NumPy); 'null' replays a
    schedule without memory or compute (tests)."""
    if kind not in ("auto", "numpy", "cupy", "null"):
        raise BackendError(f"unknown backend '{kind}'; choose auto, numpy or cupy")
    if kind == "null":
        from dataflow.backends.null_backend import NullBackend  # the planner: see the top

        return NullBackend(**options)
    if kind in ("auto", "cupy"):
        try:
            # Here, not at the top: it imports CuPy, which the NumPy backend must not load.
            from dataflow.backends.cupy_backend import CupyBackend, gpu_available
        except ImportError as exc:
            if kind == "cupy":
                raise BackendError(f"backend 'cupy' needs CuPy and a GPU: {exc}; "
                                   "install the gpu extra or use --backend numpy") from None
        else:
            if gpu_available():
                return CupyBackend(**options)
            if kind == "cupy":
                raise BackendError("backend 'cupy' found no usable GPU; use --backend numpy")
    from dataflow.backends.numpy_backend import NumpyBackend  # ml_dtypes: see the top

    return NumpyBackend(**options)
