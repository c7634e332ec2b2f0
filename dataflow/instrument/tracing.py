"""TracingBackend: wraps any Backend, delegates every method to it, and records one Span per
launch, copy and host call enqueued between begin_step and end_step. On the NumPy backend the
span is host clock time around the callable when it actually runs (at once in plain mode, at
synchronize in sanitizer mode); on the CuPy backend it is a pair of timing-enabled CUDA events
recorded on the op's stream, read back after the one end-of-step synchronize, with an NVTX range
of the same name so Nsight Systems shows the same spans. Never changes what runs or in which
order, and never synchronizes inside a step."""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from dataflow.backend import Backend, BackendError, Place, Stream
from dataflow.instrument.breakdown import StepTrace
from dataflow.instrument.spans import ROUND_MARKER, Clock, Span, SpanKind, is_optimizer


class _Meta(NamedTuple):
    """What a span will say about an enqueued item, fixed at enqueue time."""

    step: int
    round: int | None
    stream: Stream
    name: str
    kind: SpanKind
    nbytes: int


class TracingBackend(Backend):
    """`TracingBackend(make_backend("numpy"))`; then per step: begin_step(n), the step's work,
    end_step() -> StepTrace. Outside a step every call is passed through untimed."""

    def __init__(self, inner: Backend, *, nvtx: bool = True):
        self.inner = inner
        self.name, self.ops, self.writes = inner.name, inner.ops, inner.writes
        self.device_name = getattr(inner, "device_name", inner.name)
        self.device_is_host_memory = inner.device_is_host_memory
        self._epoch = time.perf_counter()
        self._step: int | None = None
        self._round: int | None = None
        self._spans: list[Span] = []
        if inner.name == "cupy" and hasattr(inner, "streams"):
            self._clock = _CudaClock(self, inner, nvtx)
        else:
            self._clock = _HostClock(self, inner)

    def __getattr__(self, attr):
        # Backend-specific extras (streams, sanitizer, memory_report) pass through.
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def lend_scratch(self, scratch: dict) -> None:
        self.inner.lend_scratch(scratch)

    # Methods the Backend base defines as no-ops are not reached by __getattr__: pass them on.
    def set_moe_experts(self, path: str) -> None:
        self.inner.set_moe_experts(path)

    def written(self, arrays) -> None:
        self.inner.written(arrays)

    def precision_counts(self) -> dict | None:
        return self.inner.precision_counts()

    def set_precision(self, precision: str) -> None:
        self.inner.set_precision(precision)

    @property
    def precision(self) -> str:
        return self.inner.precision

    def seal(self) -> None:
        self.inner.seal()

    @property
    def clock(self) -> Clock:
        return self._clock.kind

    def now_s(self) -> float:
        """Host seconds since this tracer was made (the time base of every span)."""
        return time.perf_counter() - self._epoch

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Open step `step`'s window; call with every stream idle (after the previous step)."""
        if self._step is not None:
            raise BackendError(f"begin_step({step}) while step {self._step} is open; "
                               "call end_step() first")
        self._step, self._round, self._spans = step, None, []
        self._start_s = self._clock.begin_step(step)

    def end_step(self) -> StepTrace:
        """Synchronize once, resolve every span's times and close the window."""
        if self._step is None:
            raise BackendError("end_step() without begin_step(); open a step first")
        end_s = self._clock.end_step()
        spans = tuple(sorted(self._spans, key=lambda s: (s.start_s, s.end_s)))
        trace = StepTrace(step=self._step, start_s=self._start_s, end_s=end_s, spans=spans,
                          clock=self._clock.kind)
        self._step, self._spans = None, []
        return trace

    def _add(self, meta: _Meta, start_s: float, end_s: float) -> None:
        self._spans.append(Span(*meta, start_s, end_s))

    def _traced(self, stream: Stream, name: str, kind: SpanKind, nbytes: int,
                call: Callable[[], None]) -> None:
        if self._step is None:
            call()
            return
        if name == ROUND_MARKER:
            self._round = 0 if self._round is None else self._round + 1
            self._clock.mark_round(self._round)
        rnd = None if is_optimizer(name) else self._round
        self._clock.run(_Meta(self._step, rnd, stream, name, kind, nbytes), call)

    # -- the Backend interface ------------------------------------------------------------------
    def alloc(self, nbytes: int, place: Place):
        return self.inner.alloc(nbytes, place)

    def view(self, slab, offset: int, shape, dtype: str):
        return self.inner.view(slab, offset, shape, dtype)

    def copy(self, dst, src, stream: Stream, name: str = "copy") -> None:
        self._traced(stream, name, SpanKind.COPY, int(dst.nbytes),
                     lambda: self.inner.copy(dst, src, stream, name=name))

    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        self._traced(stream, name or op, SpanKind.OP, 0,
                     lambda: self.inner.launch(stream, op, *args, name=name))

    def host_call(self, stream: Stream, fn, *, reads=(), writes=(), name: str = "host") -> None:
        self._traced(stream, name, SpanKind.HOST, 0,
                     lambda: self.inner.host_call(stream, fn, reads=reads, writes=writes,
                                                  name=name))

    def record(self, stream: Stream):
        return self.inner.record(stream)

    def wait(self, stream: Stream, event) -> None:
        self.inner.wait(stream, event)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def to_numpy(self, array):
        return self.inner.to_numpy(array)

    def memory_used_bytes(self, place: Place) -> int:
        return self.inner.memory_used_bytes(place)

    def close(self) -> None:
        self._clock.close()
        self.inner.close()


class _HostClock:
    """Host perf_counter around each callable as it runs. For the NumPy backend it wraps the
    callable handed to the backend's `_submit` (which runs it at once, or queues it for the
    sanitizer); for any other backend it times the delegated call itself, which is right only
    for backends that execute synchronously."""

    kind = Clock.HOST

    def __init__(self, tracer: TracingBackend, inner: Backend):
        self.tracer, self.inner = tracer, inner
        self.pending: _Meta | None = None
        self.original = getattr(inner, "_submit", None)
        if callable(self.original):
            inner._submit = self._submit

    def _submit(self, stream, fn, reads, writes, name):
        meta, self.pending = self.pending, None
        if meta is not None:
            fn = self._timed(fn, meta)
        return self.original(stream, fn, reads, writes, name)

    def _timed(self, fn, meta: _Meta):
        def timed():
            t0 = self.tracer.now_s()
            try:
                fn()
            finally:
                self.tracer._add(meta, t0, self.tracer.now_s())
        return timed

    def begin_step(self, step: int) -> float:
        return self.tracer.now_s()

    def mark_round(self, rnd: int) -> None:
        pass

    def run(self, meta: _Meta, call) -> None:
        if self.original is None:
            t0 = self.tracer.now_s()
            call()
            self.tracer._add(meta, t0, self.tracer.now_s())
            return
        self.pending = meta
        try:
            call()
        finally:
            self.pending = None

    def end_step(self) -> float:
        self.inner.synchronize()  # sanitizer mode: the queued (and timed) work runs here
        return self.tracer.now_s()

    def close(self) -> None:
        if self.original is not None and "_submit" in vars(self.inner):
            del self.inner._submit


class _CudaClock:
    """Timing-enabled CUDA events on the op's stream before and after each item, pooled and
    reused step after step; all read after end_step's synchronize, relative to an event
    recorded at begin_step. NVTX ranges (step, round, and one per item) for Nsight Systems."""

    kind = Clock.CUDA_EVENTS

    def __init__(self, tracer: TracingBackend, inner, nvtx: bool):
        import cupy

        self.cp, self.tracer, self.inner = cupy, tracer, inner
        self.streams = inner.streams
        self.pool: list = []
        self.used = 0
        self.pending: list[tuple[_Meta, object, object]] = []
        self.push, self.pop = _nvtx() if nvtx else (None, None)
        self.round_open = False

    def _event(self):
        if self.used == len(self.pool):
            self.pool.append(self.cp.cuda.Event(block=False, disable_timing=False))
        ev = self.pool[self.used]
        self.used += 1
        return ev

    def begin_step(self, step: int) -> float:
        self.used, self.pending, self.round_open = 0, [], False
        if self.push:
            self.push(f"step {step}")
        # The previous end_step synchronized every stream, so the device is idle and this
        # event passes at about the host time read beside it: the zero of both clocks.
        self.start = self._event()
        self.start.record(self.streams[Stream.COMPUTE])
        return self.tracer.now_s()

    def mark_round(self, rnd: int) -> None:
        if not self.push:
            return
        if self.round_open:
            self.pop()
        self.push(f"round {rnd}")
        self.round_open = True

    def run(self, meta: _Meta, call) -> None:
        stream = self.streams[meta.stream]
        before, after = self._event(), self._event()
        if self.push:
            self.push(meta.name)
        # Recorded on the item's own stream, so 'before' passes once the stream reaches the
        # item (its waits included) and 'after' once the item is done: no added ordering.
        before.record(stream)
        try:
            call()
        finally:
            after.record(stream)
            if self.pop:
                self.pop()
        self.pending.append((meta, before, after))

    def end_step(self) -> float:
        ends = []
        for stream in self.streams.values():
            ev = self._event()
            ev.record(stream)
            ends.append(ev)
        self.inner.synchronize()  # the step's one sync; every event below has passed
        if self.pop:
            if self.round_open:
                self.pop()
            self.pop()
        t0 = self.tracer._start_s
        elapsed = self.cp.cuda.get_elapsed_time  # milliseconds between two events
        for meta, before, after in self.pending:
            a = max(0.0, elapsed(self.start, before)) / 1e3
            b = max(a, elapsed(self.start, after) / 1e3)
            self.tracer._add(meta, t0 + a, t0 + b)
        self.pending = []
        return t0 + max(elapsed(self.start, ev) for ev in ends) / 1e3

    def close(self) -> None:
        self.pool.clear()


def _nvtx():
    """(push, pop) of NVTX ranges through CuPy, or (None, None) where NVTX is unavailable."""
    try:
        from cupy.cuda import nvtx
    except ImportError:
        return None, None
    if not getattr(nvtx, "available", True):
        return None, None
    return nvtx.RangePush, nvtx.RangePop
