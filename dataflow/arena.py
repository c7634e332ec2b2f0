"""Arenas: one slab per place, the plan's regions laid out in it by byte offset in a fixed order:
on the device the whole budget the executor gives (the budget less the libraries' reserve: what
the regions leave may be lent to cuDNN as workspace), on the host the regions' bytes only, rounded up
to SLAB_ROUND_BYTES (pinning what no region uses would only raise the process's RSS and its
set-up time). Views are made by name; nothing is allocated after construction.
Never decides what the regions are (dataflow.memplan.plan.memory lists them)."""

from __future__ import annotations

from dataflow.backend import Backend, BackendError, Place
from dataflow.memplan.plan.buffers import DTYPE_BYTES, TensorSpec, align, offsets


SLAB_ROUND_BYTES = 2 << 20
"""A slab smaller than its budget is a whole number of 2 MiB pages (what the host pinning maps
as huge pages where the kernel allows)."""


class Arena:
    def __init__(self, be: Backend, place: Place, budget_bytes: int,
                 regions: tuple[tuple[str, int], ...] | list[tuple[str, int]], *,
                 whole_budget: bool = True):
        """whole_budget: the slab is `budget_bytes`; else only the regions' bytes (rounded up
        to SLAB_ROUND_BYTES, at most the budget)."""
        self.be = be
        self.place = place
        self._where: dict[str, tuple[int, int]] = {}
        at = 0
        for name, nbytes in regions:
            if name in self._where:
                raise BackendError(f"arena region '{name}' listed twice")
            self._where[name] = (at, nbytes)
            at += align(nbytes)
        if at > budget_bytes:
            raise BackendError(
                f"{place.value} regions need {at / 2**30:.3f} GiB but the budget is "
                f"{budget_bytes / 2**30:.3f} GiB; the plan and the arena disagree")
        self.used_bytes = at
        size = budget_bytes if whole_budget else min(
            budget_bytes, max(SLAB_ROUND_BYTES, -(-at // SLAB_ROUND_BYTES) * SLAB_ROUND_BYTES))
        self.slab = be.alloc(size, place)

    def has(self, name: str) -> bool:
        return name in self._where and self._where[name][1] > 0

    def nbytes(self, name: str) -> int:
        return self._where[name][1]

    def view(self, name: str, shape, dtype: str, byte_offset: int = 0):
        """`shape`/`dtype` view at `byte_offset` inside region `name` (checked to fit)."""
        if name not in self._where:
            raise BackendError(f"no {self.place.value} region '{name}'")
        start, size = self._where[name]
        n = 1
        for s in shape:
            n *= s
        need = n * DTYPE_BYTES[dtype]
        if byte_offset + need > size:
            raise BackendError(f"view of {need} bytes at {byte_offset} overflows region "
                               f"'{name}' of {size} bytes")
        return self.be.view(self.slab, start + byte_offset, tuple(shape), dtype)

    def tensors(self, name: str, specs: tuple[TensorSpec, ...], byte_offset: int = 0) -> dict:
        """Named views of `specs` packed (aligned, in order) inside region `name`."""
        offs = offsets(specs)
        return {s.name: self.view(name, s.shape, s.dtype, byte_offset + offs[s.name])
                for s in specs}
