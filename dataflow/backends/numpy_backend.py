"""NumPy backend: the 'device' is a NumPy slab of exactly the device arena and the host another
of exactly the host arena (dataflow/arena.py); copies are memcpy; streams are queues. In plain
mode ops run at once in program order; in sanitizer mode they are checked for races and run in a
random order that respects events (see sanitizer.py). Never decides placement."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.lib.array_utils import byte_bounds

from dataflow import ops_numpy
from dataflow.backend import Backend, BackendError, Place, Slab, Stream
from dataflow.backends.sanitizer import Sanitizer
from dataflow.precision import check_precision

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32),
          "i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "u8": np.dtype(np.uint8)}


class NumpyBackend(Backend):
    name = "numpy"
    device_is_host_memory = True

    def __init__(self, *, sanitize: bool = False, seed: int = 0):
        self.ops = ops_numpy
        self.writes = ops_numpy.WRITES
        self.sanitizer = Sanitizer(seed) if sanitize else None
        self._slabs: list[Slab] = []
        self._owner: dict[int, tuple[int, Place]] = {}
        self.device_name = "cpu (numpy)"

    def set_precision(self, precision: str) -> None:
        """'fp8': the op table of dataflow.ops_fp8_numpy (the linear layers in the FP8 recipe)."""
        # Here, not at the top: the FP8 table is only loaded by runs that ask for it.
        from dataflow import ops_fp8_numpy

        self.ops = ops_fp8_numpy.op_table() if check_precision(precision) == "fp8" else ops_numpy
        self.precision = precision

    def alloc(self, nbytes: int, place: Place) -> Slab:
        try:
            buf = np.zeros(nbytes, dtype=np.uint8)
        except MemoryError:
            raise BackendError(f"cannot allocate {nbytes / 2**30:.2f} GiB of host memory for the "
                               f"{place.value} arena; lower the budget") from None
        slab = Slab(place=place, nbytes=nbytes, handle=buf)
        self._slabs.append(slab)
        return slab

    def view(self, slab: Slab, offset: int, shape, dtype: str):
        dt = DTYPES[dtype]
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + n > slab.nbytes:
            raise BackendError(f"view [{offset}, {offset + n}) outside a {slab.nbytes}-byte slab")
        return slab.handle[offset:offset + n].view(dt).reshape(shape)

    # -- ordering -----------------------------------------------------------------------------
    def _ranges(self, arrays, write: bool):
        out = []
        for a in arrays:
            if isinstance(a, np.ndarray) and a.size:
                lo, hi = byte_bounds(a)
                out.append((lo, hi, write))
        return out

    def _submit(self, stream: Stream, fn, reads, writes, name: str) -> None:
        if self.sanitizer is None:
            fn()
            return
        ranges = self._ranges(writes, True) + self._ranges(reads, False)
        self.sanitizer.enqueue(stream, fn, ranges, name)

    def copy(self, dst, src, stream: Stream, name: str = "copy") -> None:
        if dst.nbytes != src.nbytes:
            raise BackendError(f"copy '{name}': {src.nbytes} bytes into {dst.nbytes}")
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        self._submit(stream, lambda: np.copyto(d, s), [src], [dst], name)

    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        fn = getattr(self.ops, op)
        wpos = self.writes[op]
        writes = [a for i, a in enumerate(args) if i in wpos]
        reads = [a for i, a in enumerate(args) if i not in wpos]
        self._submit(stream, lambda: fn(*args), reads, writes, name or op)

    def host_call(self, stream: Stream, fn, *, reads=(), writes=(), name: str = "host") -> None:
        self._submit(stream, fn, reads, writes, name)

    def record(self, stream: Stream):
        return self.sanitizer.record(stream) if self.sanitizer else None

    def wait(self, stream: Stream, event) -> None:
        if self.sanitizer is not None and event is not None:
            self.sanitizer.wait(stream, event)

    def synchronize(self) -> None:
        if self.sanitizer is not None:
            self.sanitizer.drain()

    def to_numpy(self, array):
        self.synchronize()
        return np.array(array, copy=True)
