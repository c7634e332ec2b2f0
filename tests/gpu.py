"""Shared by the GPU test modules: skip the whole module unless CuPy imports and sees a GPU;
the opening of the scripts some of them run in a fresh process."""

import textwrap

import pytest


def random_bf16_preamble(seed: int) -> str:
    """Source that imports cupy as cp, numpy as np, defines BF16 and bf(shape): a fresh random
    bf16 device array (standard normal, rounded from fp32) from a generator seeded `seed`. For
    test scripts that must run in a fresh process (a first use that must really be first)."""
    return textwrap.dedent(f"""
        import cupy as cp, ml_dtypes, numpy as np

        BF16 = np.dtype(ml_dtypes.bfloat16)
        rng = np.random.default_rng({seed})
        def bf(shape):
            a = rng.standard_normal(shape).astype(np.float32).astype(BF16)
            return cp.asarray(a.view(np.uint16)).view(BF16)
        """)


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
