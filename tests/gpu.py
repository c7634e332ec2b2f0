"""Shared by the GPU test modules: skip the whole module unless CuPy imports and sees a GPU;
the opening of the scripts some of them run in a fresh process; the kernels' CudaContext a test
module launches through; moving bf16 arrays to and from the device, NaN-poisoned outputs, and the
tolerance rule of STYLE §7 (check_close) with exact-bits comparison (same_bits). Imports without
CuPy (the helpers that need it are only called by GPU tests)."""

import math
import os
import textwrap

import ml_dtypes
import numpy as np
import pytest

try:
    import cupy
except ImportError:  # the CPU machine: GPU tests skip before calling anything below
    cupy = None

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F64, I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)
FP32_FLOOR = 1e-5
"""Relative error any fp32 path may show against float64 (fp32 sums in another order)."""


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


def cuda_context():
    """A CudaContext for a test module's kernel calls, its cuDNN graph cache where
    DATAFLOW_CUDNN_CACHE_DIR says (dataflow.settings), as the CuPy backend makes its own."""
    # Imported here: dataflow.kernels.cuda needs CuPy, which the CPU machine lacks.
    from dataflow.kernels.cuda import CudaContext
    from dataflow.settings import settings_from_env

    return CudaContext(cudnn_cache_dir=settings_from_env().cudnn_cache_dir)


def bf(a) -> np.ndarray:
    """a rounded to bf16 (through fp32), on the host."""
    return np.asarray(a, dtype=F32).astype(BF16)


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(F64)


def dev(a: np.ndarray):
    """A device copy of host array a (bf16 through its bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return cupy.asarray(a.view(np.uint16)).view(BF16)
    return cupy.asarray(a)


def host(d) -> np.ndarray:
    """A host copy of device array d (bf16 through its bits)."""
    if d.dtype == BF16:
        return cupy.asnumpy(d.view(cupy.uint16)).view(BF16)
    return cupy.asnumpy(d)


def poisoned(shape, dtype):
    """A device array an op must overwrite: NaN (bf16, fp32), -7 (int64)."""
    d = cupy.empty(shape, dtype=dtype)
    if np.dtype(dtype) == BF16:
        d.view(cupy.uint16).fill(0x7FC0)
    elif np.dtype(dtype) == I64:
        d.fill(-7)
    else:
        d.fill(np.nan)
    return d


def rel(out, truth) -> float:
    """Norm-wise relative error of out against truth (inf when out is not finite)."""
    out, truth = f64(out), f64(truth)
    if not np.all(np.isfinite(out)):
        return math.inf
    return float(np.linalg.norm(out - truth) / max(np.linalg.norm(truth), 1e-300))


def check_close(name: str, out, truth, bf16_ref) -> None:
    """Assert rel(out) <= max(2 rel(bf16_ref), FP32_FLOOR) and log both errors (also to the
    file KERNEL_ERR_LOG names, when set)."""
    err, err_ref = rel(out, truth), rel(bf16_ref, truth)
    bound = max(2.0 * err_ref, FP32_FLOOR)
    line = f"{name:48s} err {err:.3e}  bf16-ref {err_ref:.3e}  bound {bound:.3e}"
    print(line)
    log = os.environ.get("KERNEL_ERR_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(line + "\n")
    assert err <= bound, line


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal dtype, shape and bytes."""
    got, want = np.asarray(got), np.asarray(want)
    return (got.dtype == want.dtype and got.shape == want.shape
            and np.array_equal(got.view(np.uint8), want.view(np.uint8)))


def sync():
    """Wait for the current CuPy stream."""
    cupy.cuda.get_current_stream().synchronize()
