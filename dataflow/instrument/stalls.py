"""Stalls: the gaps of a step's compute stream, each with what ran on the copy and host streams
meanwhile and which compute op ended the gap (the one that was waiting). Summed by the waiting
op's kind and position, they say where exposed copy time comes from ("the first backward layer
of every round waits on its weights"), which StepBreakdown's totals cannot. Reads spans or a
Chrome trace written by ChromeTraceWriter; pure Python: never touches a device or the clock.

    python -m dataflow.instrument.stalls run.json [--step N] [--top K]
    python -m dataflow.instrument.stalls --simulated plan.json [--chrome sim.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from dataflow.backend import Stream
from dataflow.instrument.breakdown import StepTrace, op_key, length, subtract, union
from dataflow.instrument.chrome import STEP_TID, STREAM_TIDS, write_chrome_trace
from dataflow.instrument.spans import Clock, Span, SpanKind
from dataflow.memplan.search.cost import event_seconds
from dataflow.memplan.plan.plan import Plan
from dataflow.memplan.step.compile import compile_schedule
from dataflow.memplan.step.sim import simulate_schedule

MIN_GAP_S = 20e-6
"""Gaps shorter than this are launch jitter, not stalls."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stall:
    start_s: float
    end_s: float
    copy_s: float
    """Time inside the gap with some H2D or D2H copy running (exposed copy)."""
    host_s: float
    """Time inside the gap with only the host stream running."""
    before: str
    """The compute span that ended when the gap began ('' at the step's start)."""
    after: str
    """The compute span that ended the gap: the op that was waiting ('' at the step's end)."""
    copies: tuple[tuple[str, float], ...]
    """(copy op key, seconds of it inside the gap), largest first."""
    round: int | None

    @property
    def gap_s(self) -> float:
        return self.end_s - self.start_s


def find_stalls(trace: StepTrace, min_gap_s: float = MIN_GAP_S) -> list[Stall]:
    """Every gap of the compute stream within the step window, in time order."""
    lo, hi = trace.start_s, trace.end_s
    comp = sorted((s for s in trace.spans if s.stream is Stream.COMPUTE and s.end_s > lo
                   and s.start_s < hi), key=lambda s: s.start_s)
    copies = [s for s in trace.spans if s.stream in (Stream.H2D, Stream.D2H)
              or (s.stream is Stream.OPT and s.nbytes)]  # a deferred update's write-backs
    host = union([(s.start_s, s.end_s) for s in trace.spans if s.stream is Stream.HOST])
    copy_iv = union([(s.start_s, s.end_s) for s in copies])
    out: list[Stall] = []
    cursor, prev = lo, None
    for span in comp + [None]:
        start = hi if span is None else max(lo, span.start_s)
        if start - cursor >= min_gap_s:
            in_copy = _clip(copy_iv, cursor, start)
            per: dict[str, float] = defaultdict(float)
            for c in copies:
                a, b = max(cursor, c.start_s), min(start, c.end_s)
                if b > a:
                    per[op_key(c.name)] += b - a
            out.append(Stall(
                start_s=cursor, end_s=start, copy_s=length(in_copy),
                host_s=length(subtract(_clip(host, cursor, start), in_copy)),
                before="" if prev is None else prev.name,
                after="" if span is None else span.name,
                copies=tuple(sorted(per.items(), key=lambda kv: -kv[1])),
                round=None if span is None else span.round))
        if span is not None and span.end_s > cursor:
            cursor, prev = span.end_s, span
    return out


def _clip(intervals, a: float, b: float):
    return [(max(a, x), min(b, y)) for x, y in intervals if y > a and x < b]


_DIGITS = re.compile(r"\d+")


def position(name: str, n_layers: int | None = None) -> str:
    """A waiting op's place with its chunk and block indices dropped but its phase and the layer's
    place kept: 'b.L15.c3.linear_bwd_w' -> 'b.L15.linear_bwd_w'. With n_layers the layer is
    folded to first/last/inner ('b.Llast.linear_bwd_w') so rounds and layers add up."""
    if not name:
        return "(step edge)"
    parts = []
    for p in name.split("."):
        m = re.fullmatch(r"L(\d+)", p)
        if m:
            if n_layers is None:
                parts.append(p)
            else:
                i = int(m.group(1))
                parts.append("L0" if i == 0 else "Llast" if i == n_layers - 1 else "Lmid")
        elif re.fullmatch(r"c\d+", p):
            continue
        else:
            parts.append(_DIGITS.sub("#", p) if p.startswith(("adamw", "layer")) else p)
    return ".".join(parts)


def summarize(stalls: list[Stall], n_layers: int | None = None
              ) -> list[tuple[str, int, float, float, str]]:
    """(waiting op position, count, exposed copy s, gap s, main copies), largest copy first."""
    acc: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, defaultdict(float)])
    for s in stalls:
        row = acc[position(s.after, n_layers)]
        row[0] += 1
        row[1] += s.copy_s
        row[2] += s.gap_s
        for k, t in s.copies:
            row[3][k] += t
    out = []
    for pos, (n, c, g, per) in acc.items():
        top = ", ".join(f"{k} {t * 1e3:.0f}" for k, t in
                        sorted(per.items(), key=lambda kv: -kv[1])[:3])
        out.append((pos, n, c, g, top))
    return sorted(out, key=lambda r: -r[2])


def report(trace: StepTrace, *, n_layers: int | None = None, top: int = 12) -> str:
    """Lines for people: the step's stalls summed by waiting op, then the longest ones."""
    stalls = find_stalls(trace)
    total_c = sum(s.copy_s for s in stalls)
    total_g = sum(s.gap_s for s in stalls)
    rows = [f"step {trace.step}: {len(stalls)} compute gaps, {total_g * 1e3:.1f} ms, "
            f"{total_c * 1e3:.1f} ms of them with a copy running",
            f"  {'waiting op':<34}{'gaps':>6}{'copy ms':>9}{'gap ms':>9}  copies running (ms)"]
    for pos, n, c, g, cps in summarize(stalls, n_layers)[:top]:
        rows.append(f"  {pos:<34}{n:>6}{c * 1e3:>9.1f}{g * 1e3:>9.1f}  {cps}")
    rows.append("  longest gaps (ms from step start):")
    for s in sorted(stalls, key=lambda s: -s.gap_s)[:top]:
        cps = ", ".join(f"{k} {t * 1e3:.1f}" for k, t in s.copies[:3])
        rows.append(f"  {(s.start_s - trace.start_s) * 1e3:>9.1f} +{s.gap_s * 1e3:6.1f}  "
                    f"round {s.round}  {s.before or '-'} -> {s.after or '-'}  [{cps}]")
    return "\n".join(rows)


# -- the planner's simulation, as a trace -----------------------------------------------------
def simulated_trace(plan, update: str = "deferred") -> StepTrace:
    """One step of `plan` as memplan's event simulation times it (its own profile), as a
    StepTrace: the same stall analysis as a measured step, at event granularity (one compute
    span per layer and chunk, not per op). update: where AdamW runs (the Engine's default:
    the previous step's, deferred into round 0; 'end' for --eager-update)."""
    sch = compile_schedule(plan, update=update)
    tl = simulate_schedule(sch, event_seconds(plan, plan.profile), plan.profile, spans=True)
    spans = tuple(Span(1, None, Stream(stream), name,
                       SpanKind.COPY if nbytes else SpanKind.OP, nbytes, a, b)
                  for stream, name, a, b, nbytes in tl.spans if stream in _STREAMS)
    return StepTrace(step=1, start_s=0.0, end_s=tl.total_s, spans=spans, clock=Clock.HOST)


_STREAMS = {s.value for s in Stream}


# -- Chrome trace reading ---------------------------------------------------------------------
_TID_STREAM = {tid: stream for stream, tid in STREAM_TIDS.items()}


def read_chrome_trace(path: str | Path) -> list[StepTrace]:
    """The steps of a trace ChromeTraceWriter wrote, each with its spans (clock as recorded)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    windows, spans = [], []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        a, b = ev["ts"] * 1e-6, (ev["ts"] + ev["dur"]) * 1e-6
        args = ev.get("args", {})
        if ev["tid"] == STEP_TID:
            windows.append((args["step"], a, b, Clock(args.get("clock", "host"))))
        else:
            spans.append(Span(args.get("step", -1), args.get("round"),
                              _TID_STREAM[ev["tid"]], ev["name"], SpanKind(args["kind"]),
                              int(args.get("bytes", 0)), a, b))
    out = []
    for step, a, b, clock in windows:
        own = tuple(s for s in spans if s.step == step)
        out.append(StepTrace(step=step, start_s=a, end_s=b, spans=own, clock=clock))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.instrument.stalls",
                                description="Where a traced step's compute stream waited, and "
                                "on which copies (reads dataflow-demo --trace output).")
    p.add_argument("trace", help="Chrome trace JSON from dataflow-demo --trace, or a plan JSON "
                   "(dataflow-plan --json) with --simulated")
    p.add_argument("--simulated", action="store_true",
                   help="the file is a plan: report the stalls of its simulated step")
    p.add_argument("--step", type=int, default=None, help="step to report (default: the last)")
    p.add_argument("--layers", type=int, default=None,
                   help="fold layer indices into L0/Lmid/Llast for a model of this many layers "
                        "(with --simulated: the plan's, unless given)")
    p.add_argument("--top", type=int, default=12, help="rows per table (default 12)")
    p.add_argument("--chrome", metavar="OUT.json",
                   help="also write the reported step as a Chrome trace (Perfetto): with "
                        "--simulated, the planner's timeline of the plan")
    args = p.parse_args(argv)
    try:
        if args.simulated:
            plan = Plan.from_json(Path(args.trace).read_text())
            steps = [simulated_trace(plan)]
            if args.layers is None:
                args.layers = plan.model.n_layers
        else:
            steps = read_chrome_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = "a plan JSON (dataflow-plan --json)" if args.simulated else \
            "a Chrome trace from dataflow-demo --trace"
        print(f"{args.trace}: cannot read it as {what}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    if not steps:
        print(f"{args.trace}: no steps in this trace", file=sys.stderr)
        return 1
    chosen = [s for s in steps if args.step is None or s.step == args.step]
    if not chosen:
        print(f"{args.trace}: no step {args.step}; it has steps "
              f"{', '.join(str(s.step) for s in steps)}", file=sys.stderr)
        return 1
    if args.chrome:
        try:
            write_chrome_trace([chosen[-1]], args.chrome, process_name="dataflow " + (
                "simulated plan" if args.simulated else "trace"))
        except OSError as e:
            print(f"{args.chrome}: cannot write the trace: {e}", file=sys.stderr)
            return 2
    try:
        print(report(chosen[-1], n_layers=args.layers, top=args.top), flush=True)
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
