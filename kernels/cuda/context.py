"""What the CUDA launchers keep between calls, owned by one CuPy backend and released with it:
compiled NVRTC modules and their kernels, cuBLAS and cuBLASLt handles with their workspace and
caches, cuDNN handles and SDPA graphs (with what built them and which shapes cuDNN refused), and
the reduction scratch a launcher allocates when its caller passes none. Every launcher of
dataflow.kernels.cuda takes a CudaContext as its first argument; nothing here is process-wide.
Never launches a kernel and never synchronises (close() aside, which the backend calls after
its own synchronize).

Everything is created on first use, so making a context is free; caches stay keyed by device
ordinal, as the launchers' state always was, so a context used under another current device
builds that device's own handles. Compiled modules are cached per context (one backend, one
set of modules); a second context in the same process loads them again from CuPy's disk cache
(CUPY_CACHE_DIR), which costs file reads, not NVRTC runs.
"""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _cublas, _cublaslt, attention


class CudaContext:
    """The handles, caches and scratch of the CUDA launchers for one backend (module docstring).
    Fields are the launchers' own (kernels/cuda/_build.py, _cublas.py, _cublaslt.py,
    attention.py, rms_norm.py, utils.py); callers read them through the methods below."""

    def __init__(self, *, cudnn_cache_dir: str | None = None):
        self.cudnn_cache_dir = cudnn_cache_dir
        """Where serialised cuDNN graphs are kept (dataflow.kernels.cuda.graph_cache): the value
        of DATAFLOW_CUDNN_CACHE_DIR the creator read (dataflow.settings), None for the default
        ~/.cache/dataflow/cudnn, "off" for none."""
        self.modules: dict = {}
        """(source, device) -> cupy.RawModule (kernels/cuda/_build.py)."""
        self.funcs: dict = {}
        """(source, kernel name, device) -> cupy.RawKernel."""
        self.sm_counts: dict[int, int] = {}
        """device -> multiprocessors (a host attribute query, cached)."""
        self.cublas_handles: dict[int, int] = {}
        """device -> cuBLAS handle (kernels/cuda/_cublas.py)."""
        self.cublas_workspaces: dict[int, tuple[int, int]] = {}
        """device -> (pointer, bytes) of the workspace set_workspace gave that handle."""
        self.libraries: dict[str, object] = {}
        """File-name prefix -> ctypes handle of a shared library this process loaded."""
        self.cublaslt_lib = None
        """libcublasLt with its argtypes set (kernels/cuda/_cublaslt.py), once loaded."""
        self.cublaslt: dict = {}
        """device -> _cublaslt._Device (handle, descriptors, layouts, algorithms)."""
        self.cudnn_handles: dict = {}
        """device -> cuDNN handle (kernels/cuda/attention.py)."""
        self.graphs: dict = {}
        """SDPA graph key -> [graph, own workspace array or None, its bytes]."""
        self.executed: set[int] = set()
        """id() of each cached graph that has run once (its kernels loaded)."""
        self.graph_origins: dict = {}
        """Graph key -> "built" or "cache" (graph_sources)."""
        self.refused: dict = {}
        """Graph keys cuDNN refused, with its reason; those shapes run on the simple kernels."""
        self.scratch: dict = {}
        """(op, device, stream, shape...) -> the scratch array a launcher made for itself."""
        # alpha and beta of every GEMM live in host memory (the handles' default pointer mode):
        # cuBLAS reads them before the call returns, so one pair serves every call.
        self.one = np.ones(1, dtype=np.float32)
        self.zero = np.zeros(1, dtype=np.float32)
        self.one_ptr, self.zero_ptr = self.one.ctypes.data, self.zero.ctypes.data
        self.scalars: dict[float, np.ndarray] = {}
        """GEMM alpha value -> its fp32 in host memory (scalar_ptr): LoRA's alpha / r."""

    def scalar_ptr(self, value: float) -> int:
        """Host address of `value` as an fp32 (1,) array kept for the context's life, for a GEMM's
        alpha: the few values a run meets (one LoRA scale) are made once each."""
        arr = self.scalars.get(value)
        if arr is None:
            arr = self.scalars[value] = np.full(1, value, dtype=np.float32)
        return arr.ctypes.data

    def graph_sources(self) -> dict[str, int]:
        """How this context's cached graphs came to be: {"built": n, "cache": m} (loaded from
        dataflow.kernels.cuda.graph_cache)."""
        out = {"built": 0, "cache": 0}
        for source in self.graph_origins.values():
            out[source] += 1
        return out

    def fallbacks(self) -> dict[tuple, str]:
        """A copy of the graph keys cuDNN refused, with its reason (run on the simple kernels)."""
        return dict(self.refused)

    def built_counts(self) -> dict[str, int]:
        """How much this context has built: cuDNN graphs, refused graph shapes, CUDA modules."""
        return {"graphs": len(self.graphs), "refused": len(self.refused),
                "modules": len(self.modules)}

    def own_workspace_bytes(self) -> int:
        """Bytes of workspace cuDNN graphs allocated for themselves (outside any lent arena)."""
        return sum(int(v[1].nbytes) for v in self.graphs.values() if v and v[1] is not None)

    def forget_graphs(self) -> None:
        """Drop every cached graph and the workspace it owns, as in a fresh process (tests that
        check that nothing outside the arena is used call this first: a graph an earlier caller
        ran without a workspace keeps its own and would hide a region that is too small)."""
        self.graphs.clear()
        self.graph_origins.clear()
        self.refused.clear()
        self.executed.clear()

    def close(self) -> None:
        """Free everything: cuDNN graphs and handles, cuBLASLt and cuBLAS handles, scratch,
        modules. Call once the device has finished every launch that used this context (the
        backend's close synchronises first) and after its cuBLAS workspace was taken back; the
        context may be used again afterwards and builds everything anew."""
        self.forget_graphs()
        attention.destroy_handles(self)
        _cublaslt.destroy(self)
        _cublas.destroy_handles(self)
        self.scratch.clear()
        self.funcs.clear()
        self.modules.clear()
        self.sm_counts.clear()
