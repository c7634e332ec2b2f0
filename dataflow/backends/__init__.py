"""Backends implementing dataflow.backend.Backend: NumPy (always; with an optional schedule
sanitizer) and CuPy (NVIDIA GPUs)."""

from __future__ import annotations


def make_backend(kind: str = "auto", **options):
    """'numpy', 'cupy', or 'auto' (CuPy when a GPU is usable, else NumPy); 'null' replays a
    schedule without memory or compute (tests)."""
    from dataflow.backend import BackendError

    if kind not in ("auto", "numpy", "cupy", "null"):
        raise BackendError(f"unknown backend '{kind}'; choose auto, numpy or cupy")
    if kind == "null":
        from dataflow.backends.null_backend import NullBackend

        return NullBackend(**options)
    if kind in ("auto", "cupy"):
        try:
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
    from dataflow.backends.numpy_backend import NumpyBackend

    return NumpyBackend(**options)
