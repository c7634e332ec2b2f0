"""Null backend: arenas of any size that hold no bytes, copies and launches that do nothing, events
that are bookkeeping only. It replays a whole step's schedule (8b at 8192 tokens, 40 rounds) in
about a second, so tests can check what the executor dispatches — its order, streams and
names — without memory or compute. Every call is logged as (kind, stream, name). Never decides
placement and never computes anything."""

from __future__ import annotations

import numpy as np

from dataflow.backend import Backend, BackendError, Place, Slab, Stream
from dataflow.memplan.plan.buffers import DTYPE_BYTES

_BYTES = DTYPE_BYTES


class NullArray:
    """Shape and element size of a view, with the slicing and reshaping the executor uses."""

    __slots__ = ("shape", "itemsize")

    def __init__(self, shape, itemsize: int):
        self.shape, self.itemsize = tuple(int(s) for s in shape), itemsize

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape = []
        for i, s in enumerate(self.shape):
            if i >= len(idx):
                shape.append(s)
            elif isinstance(idx[i], slice):
                shape.append(len(range(*idx[i].indices(s))))
            # an integer index drops the axis
        return NullArray(shape, self.itemsize)

    def __setitem__(self, idx, value) -> None:
        pass

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = 1
            for s in shape:
                known *= s if s != -1 else 1
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        return NullArray(shape, self.itemsize)

    def view(self, dtype):
        new = np.dtype(dtype).itemsize
        return NullArray(self.shape[:-1] + (self.shape[-1] * self.itemsize // new,), new)

    def fill(self, value) -> None:
        pass


class NullBackend(Backend):
    name = "null"

    def __init__(self):
        self.ops = None
        self.writes = {}
        self._slabs: list[Slab] = []
        self.device_name = "null"
        self.calls: list[tuple[str, str, str]] = []
        """(kind, stream, name) of every copy, launch, host call, record and wait, in order."""

    def set_precision(self, precision: str) -> None:
        """Any precision: the null backend computes nothing."""
        # Here, not at the top: as Backend.set_precision.
        from dataflow.precision import check_precision

        self.precision = check_precision(precision)

    def alloc(self, nbytes: int, place: Place) -> Slab:
        slab = Slab(place=place, nbytes=nbytes, handle=None)
        self._slabs.append(slab)
        return slab

    def view(self, slab: Slab, offset: int, shape, dtype: str):
        n = _BYTES[dtype]
        for s in shape:
            n *= s
        if offset < 0 or offset + n > slab.nbytes:
            raise BackendError(f"view [{offset}, {offset + n}) outside a {slab.nbytes}-byte slab")
        return NullArray(shape, _BYTES[dtype])

    def copy(self, dst, src, stream: Stream, name: str = "copy") -> None:
        if dst.nbytes != src.nbytes:
            raise BackendError(f"copy '{name}': {src.nbytes} bytes into {dst.nbytes}")
        self.calls.append(("copy", stream.value, name))

    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        self.calls.append(("launch", stream.value, name or op))

    def host_call(self, stream: Stream, fn, *, reads=(), writes=(), name: str = "host") -> None:
        self.calls.append(("host", stream.value, name))

    def record(self, stream: Stream):
        self.calls.append(("record", stream.value, ""))
        return len(self.calls)

    def wait(self, stream: Stream, event) -> None:
        self.calls.append(("wait", stream.value, ""))

    def synchronize(self) -> None:
        pass

    def to_numpy(self, array):
        return np.zeros(array.shape, dtype={4: np.float32, 8: np.int64}.get(array.itemsize,
                                                                          np.uint16))
