"""CuPy backend: one cudaMalloc of exactly the device budget and one pinned host allocation of
exactly the host budget (not through CuPy's pools, which round up), sub-allocated by offset;
compute, H2D, D2H and HOST streams (HOST runs CPU callbacks in stream order); ordering only
through CUDA events. Ops come from dataflow.ops_cuda. Never decides placement."""

from __future__ import annotations

import numpy as np

from dataflow.backend import Backend, BackendError, Place, Slab, Stream

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the package imports without the gpu extra
    cp = None

_DT = {"bf16": "bfloat16", "f32": np.float32, "i32": np.int32, "u8": np.uint8}


def gpu_available() -> bool:
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: not usable
        return False


def _dtype(name: str):
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DT[name])


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self, *, device: int = 0):
        if cp is None:
            raise BackendError("CuPy is not installed; pip install 'dataflow[gpu]'")
        from dataflow import ops_cuda

        self.device = cp.cuda.Device(device)
        self.device.use()
        self.ops = ops_cuda.CudaOps()
        self.writes = ops_cuda.WRITES
        self.streams = {s: cp.cuda.Stream(non_blocking=True) for s in Stream}
        free, self.total_bytes = cp.cuda.runtime.memGetInfo()
        self.baseline_used_bytes = self.total_bytes - free
        """Device memory in use once the CUDA context exists, before any arena."""
        self._slabs: list[Slab] = []
        self._op = ""
        from dataflow.backends.alloc_guard import AllocationGuard

        self.guard = AllocationGuard(lambda: self._op)
        props = cp.cuda.runtime.getDeviceProperties(device)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) \
            else str(props["name"])

    def alloc(self, nbytes: int, place: Place) -> Slab:
        try:
            if place is Place.DEVICE:
                mem = cp.cuda.Memory(nbytes)
                handle = cp.cuda.MemoryPointer(mem, 0)
            else:
                mem = cp.cuda.PinnedMemory(nbytes)
                handle = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes)
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
            raise BackendError(f"cannot allocate the {place.value} arena of "
                               f"{nbytes / 2**30:.2f} GiB: {exc}; lower the budget") from None
        slab = Slab(place=place, nbytes=nbytes, handle=(mem, handle))
        self._slabs.append(slab)
        return slab

    def view(self, slab: Slab, offset: int, shape, dtype: str):
        dt = _dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + n > slab.nbytes:
            raise BackendError(f"view [{offset}, {offset + n}) outside a {slab.nbytes}-byte slab")
        _, handle = slab.handle
        if slab.place is Place.HOST:
            return handle[offset:offset + n].view(dt).reshape(shape)
        return cp.ndarray(tuple(shape), dtype=dt, memptr=handle + offset)

    def copy(self, dst, src, stream: Stream, name: str = "copy") -> None:
        if dst.nbytes != src.nbytes:
            raise BackendError(f"copy '{name}': {src.nbytes} bytes into {dst.nbytes}")
        s = self.streams[stream]
        n = dst.nbytes
        d_host, s_host = isinstance(dst, np.ndarray), isinstance(src, np.ndarray)
        if d_host and s_host:
            raise BackendError(f"copy '{name}': host to host copies belong on the HOST stream")
        if d_host:
            src.data.copy_to_host_async(dst.ctypes.data, n, s)
        elif s_host:
            dst.data.copy_from_host_async(src.ctypes.data, n, s)
        else:
            dst.data.copy_from_device_async(src.data, n, s)

    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        self._op = name or op
        with self.streams[stream]:
            getattr(self.ops, op)(*args)
        self._op = ""

    def host_call(self, stream: Stream, fn, *, reads=(), writes=(), name: str = "host") -> None:
        self.streams[stream].launch_host_func(lambda _arg: fn(), None)

    def record(self, stream: Stream):
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(self.streams[stream])
        return ev

    def wait(self, stream: Stream, event) -> None:
        if event is not None:
            self.streams[stream].wait_event(event)

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.synchronize()

    def to_numpy(self, array):
        self.synchronize()
        if isinstance(array, np.ndarray):
            return np.array(array, copy=True)
        out = np.empty(array.shape, dtype=array.dtype)
        array.data.copy_to_host(out.ctypes.data, array.nbytes)
        return out

    def seal(self) -> None:
        """Setup is over: from now on a CuPy allocation is an error (see alloc_guard)."""
        self.guard.install()

    def lend_scratch(self, scratch: dict) -> None:
        """Library scratch (cuDNN workspace, bf16 dK/dV) comes from these arena views."""
        self.ops.lend_scratch(scratch)

    def memory_report(self) -> dict[str, int]:
        """What the process really uses on the device beside the budgeted arena: the CUDA
        context (baseline), library workspaces (cuBLAS, cuDNN, kernel scratch, CuPy pool) and
        the arena itself. Device-wide numbers from cudaMemGetInfo; NVML per process if present."""
        self.synchronize()
        free, total = cp.cuda.runtime.memGetInfo()
        used = total - free
        arena = self.memory_used_bytes(Place.DEVICE)
        report = {"device_used_bytes": used, "context_baseline_bytes": self.baseline_used_bytes,
                  "arena_bytes": arena,
                  "libraries_and_pool_bytes": used - self.baseline_used_bytes - arena,
                  "cupy_pool_used_bytes": cp.get_default_memory_pool().used_bytes()}
        try:
            from kernels.cuda.attention import own_workspace_bytes

            report["cudnn_workspace_bytes"] = own_workspace_bytes()
            report["op_scratch_bytes"] = self.ops.library_workspace_bytes()
        except Exception:  # noqa: BLE001 - a breakdown of the pool, best effort
            pass
        try:
            import os

            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(self.device.id)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    report["nvml_process_used_bytes"] = int(proc.usedGpuMemory)
        except Exception:  # noqa: BLE001 - NVML is a cross-check, not a requirement
            pass
        return report

    def close(self) -> None:
        self.synchronize()
        self.guard.remove()
        self._slabs.clear()
