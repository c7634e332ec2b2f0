"""CuPy backend: one cudaMalloc of exactly the device arena (the budget less the libraries'
reserve) and one pinned host slab of exactly the host arena (the plan's host regions:
dataflow/arena.py), not through CuPy's pools, which round up; sub-allocated by offset;
compute, H2D, D2H and HOST streams (HOST runs CPU callbacks in stream order); ordering only
through CUDA events. Ops come from dataflow.ops_cuda. Never decides placement.

Python host functions and the GIL: a host function queued with cudaLaunchHostFunc runs on the
driver's thread and needs the GIL, so this thread must never block inside a CUDA call that
keeps the GIL while one is pending (measured on the H100: the cuDNN frontend's handle creation
and a graph's first execute deadlock that way). Two rules keep it so. cuDNN's first-time calls
are preceded by `_quiesce` (wait until the HOST stream has run its functions). And the compute
stream is never more than RUN_AHEAD_OPS ops ahead of the GPU (`_bound_run_ahead`): a launch
into a full CUDA queue blocks, and a cuDNN launch would block with the GIL held. Both waits
poll an event with the GIL released.

The host slab is pinned one of two ways, chosen by DATAFLOW_PIN (read at each host alloc):
'register' (the default): an anonymous mmap, its pages faulted in by all threads at once (with
transparent huge pages where the kernel allows), then pinned with cudaHostRegister; freed by
cudaHostUnregister and munmap when the last view of it is gone. If mapping or registering fails
it falls back, with a warning, to 'alloc': cudaHostAlloc, which zeroes and pins every page from
one thread inside the driver. On the H100 host, 40 GiB pinned in 1.9 s this way against 27.8 s
with cudaHostAlloc, at the same copy rates (bench/records/setup-speed-h100-1b.json). Registering
in several ranges failed there (cudaErrorInvalidValue), so DATAFLOW_PIN_PIECES must stay 1.
`last_pin` says how the last host slab was pinned and how long each part took."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

import numpy as np

from dataflow.backend import Backend, BackendError, Place, Slab, Stream
from dataflow.backends.alloc_guard import AllocationGuard
from dataflow.memplan.plan.buffers import key_block_spans
from dataflow.ops_fp8_numpy import FP8_LINEAR_OPS as FP8_OPS
from dataflow.precision import check_precision
from dataflow.settings import settings_from_env

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the package imports without the gpu extra
    cp = None

_DT = {"bf16": "bfloat16", "f32": np.float32, "i32": np.int32, "i64": np.int64,
       "u8": np.uint8}
log = logging.getLogger(__name__)

PIN_METHODS = ("register", "alloc")
"""Values of DATAFLOW_PIN: how the host slab is pinned (see the module docstring)."""
_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context of the process, as cudaHostAlloc's
memory is under unified addressing (two backends on two GPUs may share a process)."""
_PIECE_ALIGN = 2 << 20
"""Registration pieces start on 2 MiB (huge page) boundaries."""
RUN_AHEAD_OPS = 256
"""Compute-stream ops the CPU may queue ahead of the GPU (a mark every RUN_AHEAD_OPS / 4),
unless DATAFLOW_RUN_AHEAD_OPS says otherwise (a multiple of 4, at least 4). Far below the CUDA
launch queue's depth (about a thousand kernels) even when an op is 3 kernels, and seconds of
GPU work at 8b: prefetch and compute still overlap fully."""


def run_ahead_ops(env=None) -> int:
    """RUN_AHEAD_OPS, or DATAFLOW_RUN_AHEAD_OPS; BackendError names a bad value."""
    raw = settings_from_env(env).run_ahead_ops
    if not raw:
        return RUN_AHEAD_OPS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 4 or n % 4:
        raise BackendError(f"DATAFLOW_RUN_AHEAD_OPS={raw!r}; give a multiple of 4, at least 4 "
                           f"(default {RUN_AHEAD_OPS}); more than about 300 can deadlock cuDNN")
    return n
_POLL_S = 1e-4


def pin_options(env=None) -> tuple[str, int]:
    """(method, pieces) from DATAFLOW_PIN and DATAFLOW_PIN_PIECES; BackendError names bad values."""
    settings = settings_from_env(env)
    method = settings.pin.strip().lower()
    if method not in PIN_METHODS:
        raise BackendError(f"DATAFLOW_PIN={method!r}; choose 'register' (mmap, parallel first "
                           "touch, cudaHostRegister) or 'alloc' (cudaHostAlloc)")
    raw = settings.pin_pieces.strip()
    try:
        pieces = int(raw)
    except ValueError:
        pieces = 0
    if pieces != 1:
        # tried on the H100 (bench/records/setup-speed-h100-1b.json): cudaHostRegister refused
        # the second of two adjacent ranges of one mapping with cudaErrorInvalidValue
        raise BackendError(f"DATAFLOW_PIN_PIECES={raw!r}: registering the slab in pieces failed "
                           "on the H100 (cudaErrorInvalidValue); leave it unset (one call)")
    return method, pieces


def piece_bounds(nbytes: int, pieces: int, align: int = _PIECE_ALIGN) -> list[tuple[int, int]]:
    """[(start, length)] of at most `pieces` consecutive ranges covering [0, nbytes), every
    start a multiple of `align`; no empty range."""
    per = -(-max(nbytes, 1) // max(pieces, 1))
    per = -(-per // align) * align
    return [(lo, min(per, nbytes - lo)) for lo in range(0, nbytes, per)]


class MappedHostMemory:
    """`nbytes` of anonymous private memory (mmap), pinned for DMA by `register(ptr, size)`
    (cudaHostRegister) in `pieces` ranges from as many threads, and released by
    `unregister(ptr)` then munmap in free(), or when the last array viewing it is gone.
    np.asarray(self) is the uint8 array of its bytes (its base is this object, so every view
    keeps the mapping alive). Fresh memory reads as zero.

    populate: 'touch' faults every page in from all threads (dataflow.kernels.host.memory.prefault_zero)
    before registering, so registration only pins present pages; 'populate' asks mmap to do it
    (MAP_POPULATE, one thread in the kernel); 'none' leaves it to the registration.
    `seconds` holds the time of each part: map, touch, register."""

    def __init__(self, nbytes: int, register, unregister, *, pieces: int = 1,
                 populate: str = "touch", hugepages: bool = True):
        if populate not in ("touch", "populate", "none"):
            raise ValueError(f"populate={populate!r}; choose 'touch', 'populate' or 'none'")
        self.nbytes = int(nbytes)
        self._unregister = unregister
        self._registered: list[int] = []
        self._map = None
        self.seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        if populate == "populate":
            flags |= getattr(mmap, "MAP_POPULATE", 0x8000)
        # mmap refuses length 0; a 0-byte slab still gets one page, of which it shows none.
        self._map = mmap.mmap(-1, max(self.nbytes, 1), flags=flags,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hugepages and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP disabled or unsupported: 4 KiB pages, still correct
                pass
        anchor = ctypes.c_char.from_buffer(self._map)
        self.ptr = ctypes.addressof(anchor)
        del anchor  # drop the buffer export at once, so free() can unmap
        self.seconds["map"] = time.perf_counter() - t0
        try:
            if populate == "touch" and self.nbytes:
                # numba (0.25 s), here: `dataflow-probe --help` imports this module.
                from dataflow.kernels.host.memory import prefault_zero

                t0 = time.perf_counter()
                whole = np.frombuffer(self._map, np.uint8, self.nbytes)
                prefault_zero(whole)
                del whole
                self.seconds["touch"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self._register_all(register, pieces)
            self.seconds["register"] = time.perf_counter() - t0
        except BaseException:
            self.free()
            raise

    def _register_all(self, register, pieces: int) -> None:
        bounds = piece_bounds(self.nbytes, pieces) if self.nbytes else []
        if len(bounds) <= 1:
            for lo, n in bounds:
                register(self.ptr + lo, n)
                self._registered.append(self.ptr + lo)
            return
        errors: list[BaseException] = []
        lock = threading.Lock()

        def one(lo: int, n: int) -> None:
            try:
                register(self.ptr + lo, n)  # CuPy releases the GIL around the CUDA call
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the joins
                with lock:
                    errors.append(exc)
                return
            with lock:
                self._registered.append(self.ptr + lo)

        threads = [threading.Thread(target=one, args=b, daemon=True) for b in bounds]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    @property
    def __array_interface__(self) -> dict:
        if self._map is None:
            raise ValueError("this host memory was freed")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3}

    @property
    def registered_pieces(self) -> int:
        return len(self._registered)

    def free(self) -> None:
        """Unregister every pinned range, then unmap. Idempotent. Every array made from this
        object must be gone (or never used again)."""
        while self._registered:
            ptr = self._registered.pop()
            try:
                self._unregister(ptr)
            except Exception as exc:  # noqa: BLE001 - at exit the CUDA context may be gone
                log.debug("cudaHostUnregister(%#x) failed: %s", ptr, exc)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an export is still alive (a failed touch's frame): GC unmaps
                log.debug("host mapping still exported; left to the garbage collector")
            self._map = None

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - a finaliser must not raise
            pass


def _wait_polling(event) -> None:
    """Block until `event` has passed, sleeping (GIL released) between queries, so host
    functions queued before it can take the GIL and finish."""
    while not event.done:
        time.sleep(_POLL_S)


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
        from collections import deque

        # Imported here, as CuPy is: this module imports without the gpu extra.
        from dataflow import ops_cuda
        from dataflow.kernels.cuda.context import CudaContext  # CuPy, as ops_cuda

        self.device = cp.cuda.Device(device)
        self.device.use()
        self.streams = {s: cp.cuda.Stream(non_blocking=True) for s in Stream}
        self.kernels = CudaContext(cudnn_cache_dir=settings_from_env().cudnn_cache_dir)
        """The CUDA kernels' compiled modules, library handles, cuDNN graphs and scratch: this
        backend's own, released by close()."""
        self.ops = ops_cuda.CudaOps(self.kernels, quiesce=self._quiesce, wait=_wait_polling)
        self.writes = ops_cuda.WRITES
        self._compute_ops = 0
        self._mark_every = run_ahead_ops() // 4
        self._marks: deque = deque()
        free, self.total_bytes = cp.cuda.runtime.memGetInfo()
        self.baseline_used_bytes = self.total_bytes - free
        """Device memory in use once the CUDA context exists, before any arena."""
        self._slabs: list[Slab] = []
        self.last_pin: dict | None = None
        """How the last host slab was pinned: method, pieces, seconds (and map/touch/register
        seconds for 'register'); None before any host slab."""
        self._op = ""
        self._fp8 = None
        """dataflow.ops_cuda_fp8.Fp8Linears while the precision is fp8."""
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
                mem, handle = self._pinned_host(nbytes)
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
            raise BackendError(f"cannot allocate the {place.value} arena of "
                               f"{nbytes / 2**30:.2f} GiB: {exc}; lower the budget") from None
        slab = Slab(place=place, nbytes=nbytes, handle=(mem, handle))
        self._slabs.append(slab)
        return slab

    def _pinned_host(self, nbytes: int):
        """(owner, uint8 array of nbytes) of pinned host memory, as DATAFLOW_PIN says; records
        `last_pin`."""
        method, pieces = pin_options()
        t0 = time.perf_counter()
        if method == "register":
            try:
                mem = MappedHostMemory(
                    nbytes, lambda ptr, n: cp.cuda.runtime.hostRegister(
                        ptr, n, _HOST_REGISTER_PORTABLE),
                    cp.cuda.runtime.hostUnregister, pieces=pieces)
            except (OSError, MemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
                log.warning("pinning %.2f GiB with mmap + cudaHostRegister failed (%s); "
                            "falling back to cudaHostAlloc (DATAFLOW_PIN=alloc skips the try)",
                            nbytes / 2**30, exc)
                method = "alloc (register failed)"
            else:
                self.last_pin = {"method": "register", "nbytes": nbytes,
                                 "pieces": mem.registered_pieces,
                                 "seconds": time.perf_counter() - t0, **{
                                     f"{k}_s": v for k, v in mem.seconds.items()}}
                return mem, np.asarray(mem)
        t0 = time.perf_counter()
        mem = cp.cuda.PinnedMemory(nbytes)
        handle = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes)
        self.last_pin = {"method": method, "nbytes": nbytes, "pieces": 1,
                         "seconds": time.perf_counter() - t0}
        return mem, handle

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
        if self._fp8 is not None:  # it may write an FP8 op's source
            self._fp8.wrote((dst,))
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
        if self._fp8 is None:
            pass
        elif op in FP8_OPS:  # its site: where its operands' scales are guessed from
            self._fp8.at(self._op)
        else:  # it may write an FP8 op's source
            self._fp8_wrote(op, args)
        with self.streams[stream]:
            getattr(self.ops, op)(*args)
        self._op = ""
        if stream is Stream.COMPUTE:
            self._bound_run_ahead()

    def _fp8_wrote(self, op: str, args) -> None:
        """Tell the FP8 ops what `op` writes (its WRITES positions); all of it for an op
        WRITES does not name."""
        at = self.writes.get(op)
        if at is None:
            self._fp8.forget()
        else:
            self._fp8.wrote(args[i] for i in at if i < len(args))

    def _bound_run_ahead(self) -> None:
        """Mark the compute stream every run_ahead_ops() / 4 ops; past four marks, wait for the
        oldest (module docstring: a full launch queue must never block a GIL-holding call)."""
        self._compute_ops += 1
        if self._compute_ops % self._mark_every:
            return
        self._marks.append(self.record(Stream.COMPUTE))
        if len(self._marks) > 4:
            _wait_polling(self._marks.popleft())

    def _quiesce(self) -> None:
        """Wait until every host function queued so far has run (GIL released)."""
        _wait_polling(self.record(Stream.HOST))

    def host_call(self, stream: Stream, fn, *, reads=(), writes=(), name: str = "host") -> None:
        if self._fp8 is not None and writes:  # it may write an FP8 op's source
            self._fp8.wrote(writes)
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

    def set_precision(self, precision: str) -> None:
        """'fp8' (an sm_89+ GPU): the linear ops of dataflow.ops_cuda_fp8 in the table's place;
        'bf16' puts the table's own back."""
        # Here, not at the top: the FP8 modules are only loaded by runs that ask for them.
        from dataflow.kernels.cuda.fp8 import require_fp8
        from dataflow.ops_cuda_fp8 import Fp8Linears  # (as the line above)

        if check_precision(precision) == "fp8":
            try:
                require_fp8()
            except RuntimeError as e:  # an older GPU: refused by name, as a bad setting
                raise BackendError(str(e)) from None
        if precision == "fp8" and self.precision != "fp8":
            self._fp8 = Fp8Linears(self.ops)
            self._fp8.install()
        elif precision == "bf16" and self.precision == "fp8":
            for name, fn in self._fp8.bf16.items():
                setattr(self.ops, name, fn)
            self._fp8 = None
        self.precision = precision

    def written(self, arrays) -> None:
        if self._fp8 is not None:
            self._fp8.wrote(arrays)

    def precision_counts(self) -> dict | None:
        """fp8: {'guessed': quantisations that cast with their site's last scale, 'missed':
        those cast again} (synchronises); None in bf16 or where nothing guessed."""
        counts = None if self._fp8 is None else self._fp8.guess_counts()
        return None if counts is None else {"guessed": counts[0], "missed": counts[1]}

    def set_moe_experts(self, path: str) -> None:
        """The op table's expert GEMMs on `path` (the plan's), unless DATAFLOW_MOE_EXPERTS forces
        'loop' or 'grouped' (dataflow.ops_cuda_moe)."""
        self.ops.set_moe_experts(path)

    def lend_scratch(self, scratch: dict) -> None:
        """Library scratch (cuDNN workspace, bf16 dK/dV) comes from these arena views."""
        self.ops.lend_scratch(scratch)

    def warm_up(self, attention_shapes, n_heads: int, n_kv_heads: int,
                head_dim: int) -> dict[str, float]:
        """Build what the first step would build on first use: every CUDA module of
        dataflow.kernels.cuda (NVRTC, or CuPy's disk cache on a later run) and cuDNN's handle and SDPA
        graphs, forward and backward, for each of `attention_shapes` (dataflow.warmup's
        AttentionShape: n_q, q_offset). The backward of a chunk that attends only to itself is
        built deterministic, and also non-deterministic when the deterministic workspace does
        not fit the lent attention workspace (the choice dataflow.ops_cuda makes at run time).
        Allocates nothing from the device arena; call after lend_scratch, before the first
        step (what prebuild built already is found at once). Seconds per part, and the
        backend's graph counts (attention_graphs_built, attention_graphs_from_cache:
        dataflow.kernels.cuda.graph_cache's disk cache)."""
        seconds = self._build(attention_shapes, (n_heads, n_kv_heads, head_dim),
                              self.ops.attention_workspace_nbytes())
        sources = self.kernels.graph_sources()  # how many built, how many read from the disk
        seconds["attention_graphs_built"] = sources["built"]
        seconds["attention_graphs_from_cache"] = sources["cache"]
        return seconds

    def prebuild(self, attention_shapes, n_heads: int, n_kv_heads: int,
                 head_dim: int) -> dict[str, float]:
        """warm_up's builds before the arenas exist, for a thread that runs while setup pins
        host memory (dataflow.warmup.start_prebuild): the lent workspace is not known yet, so a
        self-only chunk's backward is built both deterministic and not. Enqueues no kernel and
        allocates nothing from CuPy's pool. Seconds per part."""
        self.device.use()  # this thread's current device
        return self._build(attention_shapes, (n_heads, n_kv_heads, head_dim), None)

    def _build(self, attention_shapes, heads: tuple[int, int, int], ws_bytes) -> dict:
        # CuPy, here: this module imports without the gpu extra.
        from dataflow.kernels import cuda as K
        from dataflow.kernels.cuda.warm import precompile  # CuPy, as above

        seconds = {}
        t0 = time.perf_counter()
        ctx = self.kernels
        with self.streams[Stream.COMPUTE]:
            precompile(ctx)
            seconds["cuda_modules"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for shape in attention_shapes:
                args = (shape.n_q, *heads, shape.q_offset)
                K.attention_workspace_bytes(ctx, "fwd", *args)
                if shape.self_only:
                    need = K.attention_workspace_bytes(ctx, "bwd", *args, deterministic=True)
                    if ws_bytes is None or need > ws_bytes:
                        K.attention_workspace_bytes(ctx, "bwd", *args, deterministic=False)
                    continue
                block = shape.key_block or shape.q_offset + shape.n_q
                for a, b, causal in key_block_spans(shape.q_offset, shape.n_q, block):
                    if causal:  # as dataflow.ops_cuda calls it: keys [a, b), offset - a
                        K.attention_workspace_bytes(ctx, "bwd", shape.n_q, *heads,
                                                    shape.q_offset - a, deterministic=False)
                    else:
                        K.attention_workspace_bytes(ctx, "bwd", shape.n_q, *heads,
                                                    deterministic=False, n_keys=b - a)
            seconds["attention_graphs"] = time.perf_counter() - t0
        return seconds

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
            report["cudnn_workspace_bytes"] = self.kernels.own_workspace_bytes()
            report["op_scratch_bytes"] = self.ops.library_workspace_bytes()
        except Exception:  # noqa: BLE001 - a breakdown of the pool, best effort
            pass
        try:
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
        release = getattr(self.ops, "release_scratch", None)  # a stub table (tests) lends nothing
        if release is not None:
            release()
        self.kernels.close()  # after the table gave the cuBLAS handle's workspace back
        self._marks.clear()
        self.guard.remove()
        self._slabs.clear()
