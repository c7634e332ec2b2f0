"""Chrome trace export: steps' spans as trace-event JSON ("ph": "X" complete events, times in
microseconds), one track per stream plus a track of step windows, with step/round/layer/chunk,
category and bytes in each event's args. Opens in Perfetto (ui.perfetto.dev) and
chrome://tracing. Writes events as steps arrive, so a long run never holds them all. Never
touches a device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from dataflow.backend import Stream
from dataflow.instrument.breakdown import StepTrace
from dataflow.instrument.spans import Span, parse_name

PID = 1
STEP_TID = 0
STREAM_TIDS = {Stream.COMPUTE: 1, Stream.H2D: 2, Stream.D2H: 3, Stream.HOST: 4, Stream.OPT: 5}
"""Track ids: the thread names are the streams' values (compute, h2d, d2h, host, opt)."""


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def span_event(span: Span) -> dict:
    """One complete ("X") event for a span."""
    args = {"step": span.step, **parse_name(span.name), "kind": span.kind.value}
    if span.round is not None:
        args["round"] = span.round
    if span.nbytes:
        args["bytes"] = span.nbytes
    return {"name": span.name, "cat": span.kind.value, "ph": "X", "ts": _us(span.start_s),
            "dur": _us(span.duration_s), "pid": PID, "tid": STREAM_TIDS[span.stream],
            "args": args}


def metadata_events(process_name: str) -> list[dict]:
    """Process and thread names, and the track order: steps, compute, h2d, d2h, host."""
    out = [{"name": "process_name", "ph": "M", "pid": PID, "args": {"name": process_name}}]
    tracks = [(STEP_TID, "steps")] + [(tid, s.value) for s, tid in STREAM_TIDS.items()]
    for tid, name in tracks:
        out.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
                    "args": {"name": name}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                    "args": {"sort_index": tid}})
    return out


_TAIL = b"\n]}\n"


class ChromeTraceWriter:
    """`with ChromeTraceWriter("run.json") as w: w.add(step_trace)` per step. The file is a
    valid JSON object {"traceEvents": [...]} after every add, not only once closed: each add
    writes its events and the closing brackets, flushes, and the next add writes over those
    brackets. A run killed or interrupted between steps leaves a trace that opens."""

    def __init__(self, path: str | Path, *, process_name: str = "dataflow"):
        self.path = Path(path)
        self._f = open(self.path, "wb")
        self._f.write(b'{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._first = True
        self.n_events = 0
        for ev in metadata_events(process_name):
            self._write(ev)
        self._seal()

    def _write(self, event: dict) -> None:
        text = ("" if self._first else ",\n") + json.dumps(event, separators=(",", ":"))
        self._f.write(text.encode())
        self._first = False
        self.n_events += 1

    def _seal(self) -> None:
        """Close the JSON and flush, then step back so the next event replaces the brackets."""
        end = self._f.tell()
        self._f.write(_TAIL)
        self._f.flush()
        self._f.seek(end)

    def add(self, trace: StepTrace) -> None:
        """The step's window on the steps track, then every span on its stream's track."""
        self._write({"name": f"step {trace.step}", "cat": "step", "ph": "X",
                     "ts": _us(trace.start_s), "dur": _us(trace.wall_s), "pid": PID,
                     "tid": STEP_TID, "args": {"step": trace.step, "clock": trace.clock.value,
                                              "spans": len(trace.spans)}})
        for span in trace.spans:
            self._write(span_event(span))
        self._seal()

    def add_span(self, span: Span) -> None:
        self._write(span_event(span))
        self._seal()

    def close(self) -> None:
        if not self._f.closed:
            self._f.write(_TAIL)
            self._f.truncate()
            self._f.close()

    def __enter__(self) -> "ChromeTraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_chrome_trace(items: Iterable[StepTrace | Span], path: str | Path, *,
                       process_name: str = "dataflow") -> int:
    """Write step traces (each with its window on the steps track) or bare spans to `path`;
    returns the number of events written, metadata included."""
    with ChromeTraceWriter(path, process_name=process_name) as w:
        for item in items:
            if isinstance(item, StepTrace):
                w.add(item)
            else:
                w.add_span(item)
        return w.n_events
