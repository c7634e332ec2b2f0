"""The small interface the executor is written against: memory (slabs allocated once, viewed by
offset), transfer (async copies), compute (launch an op from the backend's op table on a stream)
and dependencies (record / wait events, synchronize). Backends implement it; the executor never
sees CuPy or NumPy specifics beyond array views. Never decides placement."""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable


class Stream(enum.Enum):
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"
    """CPU work ordered with the device streams (host AdamW, embedding gather/scatter)."""
    OPT = "opt"
    """A deferred AdamW's kernels and write-backs (dataflow.memplan.step.compile), beside the round's own
    copies, so the activations' write-backs never queue behind the update's fetches."""


class Place(enum.Enum):
    DEVICE = "device"
    HOST = "host"


class BackendError(RuntimeError):
    """A backend cannot do what was asked (no GPU, allocation refused, a schedule race)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Slab:
    """One allocation made at start; regions are views into it by byte offset."""

    place: Place
    nbytes: int
    handle: Any
    """The backend's buffer (a NumPy uint8 array, a CuPy memory pointer, ...)."""


class Backend(abc.ABC):
    name: str
    ops: Any
    """The op table: functions with the signatures of dataflow.ops_numpy."""
    writes: dict[str, tuple[int, ...]]
    """For each op name, the positions of the arguments it writes (the rest are read)."""
    device_is_host_memory: bool = False
    """True when device views are host arrays (the NumPy backend): setup uploads write them
    directly instead of staging through pinned memory."""

    @abc.abstractmethod
    def alloc(self, nbytes: int, place: Place) -> Slab:
        """One slab of exactly `nbytes`; called at start only, never in the hot loop."""

    @abc.abstractmethod
    def view(self, slab: Slab, offset: int, shape: tuple[int, ...], dtype: str):
        """An array of `shape` and dtype ('bf16', 'f32', 'i32', 'i64', 'u8') at `offset` in
        `slab`."""

    @abc.abstractmethod
    def copy(self, dst, src, stream: Stream, name: str = "copy") -> None:
        """Async copy of equal byte counts; the direction follows where the views live."""

    @abc.abstractmethod
    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        """Enqueue op `op` of the op table on `stream` (HOST: a CPU function of the host ops)."""

    @abc.abstractmethod
    def host_call(self, stream: Stream, fn: Callable[[], None], *, reads=(), writes=(),
                  name: str = "host") -> None:
        """Enqueue a CPU function ordered on `stream`, touching only the given host arrays."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> Any:
        """An event marking everything enqueued on `stream` so far."""

    @abc.abstractmethod
    def wait(self, stream: Stream, event: Any) -> None:
        """Later work on `stream` starts only after `event` has passed."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until every stream is idle."""

    @abc.abstractmethod
    def to_numpy(self, array) -> Any:
        """A host NumPy copy of a view (synchronous; for results and tests, not the hot loop)."""

    precision: str = "bf16"
    """What the op table computes the linear layers in (dataflow.precision)."""

    def set_precision(self, precision: str) -> None:
        """Run the linear layers in `precision` from now on (before setup). Every backend runs
        'bf16'; one with an FP8 op table overrides this for 'fp8'."""
        # Here, not at the top: dataflow.precision imports the models' errors, which the
        # backend interface otherwise does not need.
        from dataflow.precision import check_precision

        if check_precision(precision) != "bf16":
            raise BackendError(
                f"precision {precision!r} is not built for the {self.name} backend: FP8 runs on "
                "the CuPy backend (an sm_89+ GPU) and on 'numpy' (the recipe on the CPU, "
                "docs/fp8.md); use precision 'bf16' here")
        self.precision = precision

    def seal(self) -> None:
        """Setup is over: every later device byte must come from the arenas (the CuPy backend
        then refuses allocations; others have nothing to guard)."""

    def lend_scratch(self, scratch: dict) -> None:
        """Let library calls use arena views as their scratch: 'attn_workspace' (cuDNN's
        workspace), 'dk16' / 'dv16' (bf16 dK/dV of a context). Backends whose ops need no
        scratch ignore it."""

    def written(self, arrays) -> None:
        """`arrays` (views) were written by something other than this backend's copies, ops and
        host calls (a ring transport's receive, all-reduce or gather): drop anything derived
        from them (the CuPy backend's FP8 operand copies). Backends that keep nothing ignore it."""

    def precision_counts(self) -> dict | None:
        """What the precision's kernels counted (the CuPy backend's fp8: its guessed scales and
        their misses), for a run's record; None where nothing is counted. May synchronise."""
        return None

    def set_moe_experts(self, path: str) -> None:
        """Run the routed experts' GEMMs on `path` ('loop' or 'grouped', the planner's
        memplan.search.expert_cost.expert_path) from now on. Backends with one way to run them ignore
        it."""

    def memory_used_bytes(self, place: Place) -> int:
        return sum(s.nbytes for s in self._slabs if s.place is place)

    def close(self) -> None:
        self._slabs.clear()
