"""The allocation guard: once an engine is set up, every device byte it touches is a region of its
arena, so any CuPy allocation after that point is a bug in the plan (a library scratch the
planner does not count). The guard replaces CuPy's allocator and, by mode, refuses such an
allocation with an error naming the op that asked ('error', the default), logs it and lets it
through ('warn'), or stays out of the way ('off'). Mode from DATAFLOW_ALLOC_GUARD or the
constructor (dataflow.settings). Never allocates anything itself and never decides placement."""

from __future__ import annotations

import logging

from dataflow.backend import BackendError
from dataflow.settings import settings_from_env

log = logging.getLogger("dataflow.alloc_guard")
MODES = ("error", "warn", "off")


class OutsideArenaError(BackendError):
    """A device allocation outside the arena after setup."""


class AllocationGuard:
    def __init__(self, current_op, mode: str | None = None):
        """current_op: a callable returning the name of the op being launched (or '')."""
        self.mode = (mode or settings_from_env().alloc_guard).lower()
        if self.mode not in MODES:
            raise BackendError(f"DATAFLOW_ALLOC_GUARD={self.mode!r}; choose one of "
                               f"{', '.join(MODES)}")
        self.current_op = current_op
        self.outside_bytes = 0
        """Bytes let through in 'warn' mode."""
        self._previous = None
        self._installed = False

    def install(self) -> None:
        if self.mode == "off" or self._installed:
            return
        import cupy

        self._previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(self._allocate)
        self._installed = True

    def remove(self) -> None:
        if self._installed:
            import cupy

            cupy.cuda.set_allocator(self._previous)
            self._installed = False

    def _allocate(self, nbytes: int):
        op = self.current_op() or "outside any op"
        msg = (f"device allocation of {nbytes:,} bytes outside the arena after setup, during "
               f"'{op}': the plan does not count this scratch (a bug; report it). "
               "DATAFLOW_ALLOC_GUARD=warn lets it through and logs it")
        if self.mode == "error":
            raise OutsideArenaError(msg)
        self.outside_bytes += nbytes
        log.warning("%s", msg)
        return self._previous(nbytes)
