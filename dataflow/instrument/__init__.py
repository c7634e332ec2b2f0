"""Instrumentation: where every millisecond and byte of a step went. TracingBackend wraps any
Backend and records one span per op, copy and host call; StepBreakdown partitions a step's wall
time from those spans; ChromeTraceWriter exports them for Perfetto; PcieCounter reads NVML's
byte counters as a cross-check. The run log is dataflow.metrics_log, progress dataflow.progress.
Nothing here decides or changes what runs."""

from dataflow.instrument.breakdown import StepBreakdown, StepTrace, compute_breakdown, op_totals
from dataflow.instrument.chrome import ChromeTraceWriter, write_chrome_trace
from dataflow.instrument.pcie import (PcieBytes, PcieCounter, PcieSampler, expected_link_bytes,
                                      pcie_counters)
from dataflow.instrument.spans import Clock, Span, SpanKind, parse_name
from dataflow.instrument.tracing import TracingBackend

__all__ = ["ChromeTraceWriter", "Clock", "PcieBytes", "PcieCounter", "PcieSampler", "Span",
           "SpanKind", "StepBreakdown", "StepTrace", "TracingBackend", "compute_breakdown",
           "expected_link_bytes", "op_totals", "parse_name", "pcie_counters",
           "write_chrome_trace"]
