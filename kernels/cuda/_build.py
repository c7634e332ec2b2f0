"""Compiles the CUDA C++ sources of this package once and hands out their kernels; checks the
arrays each launcher receives. Never allocates device memory and never synchronises: launchers
built on it stay safe inside the engine's hot loop.

Each `.cu` is compiled by NVRTC (through `cupy.RawModule`) with `_common.cuh` pasted in front,
once per device and CudaContext (kernels/cuda/context.py keeps them), with every template
instantiation its launcher names (`name_expressions`): one NVRTC run per source instead of one
per (op, dtype) keeps the first call cheap.

Compiled modules are cached on disk by CuPy (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache; the
key hashes the source, options, NVRTC version and GPU arch; CuPy >= 14.2 also stores the
mangled names of `name_expressions` beside the cubin, so a template module is cached too). A
second process then loads cubins instead of running NVRTC. `precompile(ctx)` builds (or loads)
every module of the package at once, so setup can pay for it instead of the first step.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import time

import cupy
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

_HERE = pathlib.Path(__file__).resolve().parent
_OPTIONS = ("--std=c++17",)


def kernel(ctx, source: str, names: tuple[str, ...], name: str) -> cupy.RawKernel:
    """The compiled kernel `name` (one of `names`, the instantiations listed for `source`),
    cached in the CudaContext `ctx`."""
    dev = cupy.cuda.runtime.getDevice()
    fn = ctx.funcs.get((source, name, dev))
    if fn is None:
        if name not in names:
            raise KeyError(f"{name} is not among the instantiations of {source}: {names}")
        fn = _module(ctx, source, names, dev).get_function(name)
        ctx.funcs[(source, name, dev)] = fn
    return fn


def _module(ctx, source: str, names: tuple[str, ...], dev: int) -> cupy.RawModule:
    mod = ctx.modules.get((source, dev))
    if mod is None:
        code = (_HERE / "_common.cuh").read_text() + "\n" + (_HERE / source).read_text()
        mod = cupy.RawModule(code=code, options=_OPTIONS, name_expressions=names)
        ctx.modules[(source, dev)] = mod
    return mod


def kernel_sources() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(source, instantiations) of every launcher module in dataflow.kernels.cuda: each module that names
    its `.cu` in `_SRC` and the instantiations in `_NAMES`."""
    # Not at the top: an import circle (the package's __init__ imports the launchers, which
    # import this module).
    import dataflow.kernels.cuda as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"dataflow.kernels.cuda.{info.name}")
        src, names = getattr(mod, "_SRC", None), getattr(mod, "_NAMES", None)
        if isinstance(src, str) and names:
            found[src] = tuple(names)
    return tuple(sorted(found.items()))


def precompile(ctx, sources=None, workers: int | None = None) -> dict[str, float]:
    """Compile (or load from CuPy's disk cache) every module of `sources` ((source, names)
    pairs; default kernel_sources()) for the current device into the CudaContext `ctx`, and
    return the seconds each took.
    Call at setup: the first launch of each kernel then finds its module in memory. Runs NVRTC
    on the host, one module per thread of `workers` (default: up to 8 and the CPU count; CuPy
    releases the GIL inside NVRTC, so cold compiles run side by side); enqueues nothing and
    never synchronises."""
    from concurrent.futures import ThreadPoolExecutor

    dev = cupy.cuda.runtime.getDevice()
    mods = [(source, _module(ctx, source, tuple(names), dev))  # here: ctx.modules, one writer
            for source, names in (kernel_sources() if sources is None else sources)]

    def build(item):
        source, mod = item
        cupy.cuda.Device(dev).use()  # a worker thread's current device
        t0 = time.perf_counter()
        mod.compile()
        return source, time.perf_counter() - t0

    workers = workers or max(1, min(8, len(mods), os.cpu_count() or 1))
    if workers == 1:
        return dict(map(build, mods))
    with ThreadPoolExecutor(workers, thread_name_prefix="dataflow-nvrtc") as pool:
        return dict(pool.map(build, mods))


def cache_dir() -> str:
    """Where CuPy keeps compiled modules (read once, when CuPy's compiler is imported)."""
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def sm_count(ctx) -> int:
    """Multiprocessors of the current device (cached in `ctx`; a host attribute query, no sync)."""
    dev = cupy.cuda.runtime.getDevice()
    n = ctx.sm_counts.get(dev)
    if n is None:
        n = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        ctx.sm_counts[dev] = n
    return n


def ctype(dtype, what: str, allowed=(BF16, F32)) -> str:
    """C++ storage type name for `dtype` ('bf16' or 'float'); raises for any other."""
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        names = ", ".join(str(a) for a in allowed)
        raise TypeError(f"{what} has dtype {dtype}; this op takes {names}")
    return "bf16" if dtype == BF16 else "float"


def check(what: str, a, shape: tuple[int, ...] | None = None, dtypes=(BF16, F32)) -> None:
    """Raise unless `a` is a C-contiguous CuPy array of `shape` (if given), of an allowed dtype."""
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{what} must be a cupy.ndarray, got {type(a).__name__}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(a.shape)}; expected {tuple(shape)}")
    if np.dtype(a.dtype) not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{what} has dtype {a.dtype}; this op takes {names}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (strides {a.strides}); "
                         "pass a contiguous view")


def aligned16(*arrays) -> bool:
    """True when every array starts on a 16-byte boundary (the 8-wide vector paths need it)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def flat_grid(ctx, n_items: int, block: int, waves: int = 8) -> int:
    """Blocks for a grid-stride loop over n_items: enough to fill the device, never more."""
    return max(1, min(-(-n_items // block), sm_count(ctx) * waves))
