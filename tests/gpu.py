"""Shared by the GPU test modules: skip the whole module unless CuPy imports and sees a GPU."""

import pytest


def require_gpu():
    """The cupy module, or a module-level skip ('no GPU')."""
    cp = pytest.importorskip("cupy")
    try:
        has_gpu = cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: not usable
        has_gpu = False
    if not has_gpu:
        pytest.skip("no GPU", allow_module_level=True)
    return cp
