"""Where a traced step's time went, by kind of op: reads a Chrome trace that `dataflow-demo
--trace FILE.json` wrote and prints, per stream, the op kinds with their count, summed span
time, share of the step's wall time and mean span, largest first, plus the compute stream's
idle gaps. An op kind is dataflow.instrument.breakdown.op_key of the span's name (its layer,
chunk and block indices dropped: 'f.L3.c1.linear_fwd' -> 'f.linear_fwd'), so one line sums
every layer and chunk; `dataflow-demo` logs each step's five largest compute kinds the same way. Made for a step that runs far below its prediction (docs/moe.md): one traced step on the
GPU and this table in the same call show which ops hold the time, without carrying the trace
back.

    python -m dataflow.bench.trace_ops t.json --step 2 --top 20 --out ops.json

Span times are what the trace measured (CUDA events around each op on the GPU: an op whose
launches the host feeds slower than the GPU runs them spans its host time too). Pure Python;
never touches a device."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

from dataflow.instrument.breakdown import op_key

def read_trace(path: Path) -> tuple[list[dict], dict[int, str]]:
    """(complete spans, thread id -> stream name) of a dataflow-demo trace, plain or .gz."""
    try:  # a gzipped trace too, as bench/records keeps them
        raw = path.read_bytes()
        doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable Chrome trace ({exc}); write one with "
                         "dataflow-demo --trace FILE.json")
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise SystemExit(f"{path}: no traceEvents list; is it a dataflow-demo --trace file?")
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], names


def summarize(events: list[dict], names: dict[int, str], step: int | None = None) -> dict:
    """{'step', 'wall_ms', 'streams': {stream: [{'op', 'count', 'total_ms', 'share',
    'mean_us'}...]}, 'compute_idle_ms'} for one step (the last traced one when None)."""
    steps = sorted({e["args"]["step"] for e in events if "step" in e.get("args", {})})
    if not steps:
        raise SystemExit("the trace holds no step's spans")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise SystemExit(f"--step {step}: the trace holds steps {steps}")
    window = [e for e in events if e["name"] == f"step {step}"]
    spans = [e for e in events if e.get("args", {}).get("step") == step
             and not e["name"].startswith("step ")]
    if window:
        t0, wall = window[0]["ts"], window[0]["dur"]
    else:
        t0 = min(e["ts"] for e in spans)
        wall = max(e["ts"] + e["dur"] for e in spans) - t0
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in spans:
        table[names.get(e["tid"], str(e["tid"]))][op_key(e["name"])].append(e["dur"])
    streams = {}
    for stream, ops in table.items():
        rows = [{"op": op, "count": len(d), "total_ms": sum(d) / 1e3,
                 "share": sum(d) / wall if wall else 0.0, "mean_us": sum(d) / len(d)}
                for op, d in ops.items()]
        streams[stream] = sorted(rows, key=lambda r: -r["total_ms"])
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                     if names.get(e["tid"]) == "compute")
    idle, end = 0.0, t0
    for a, b in compute:
        idle += max(0.0, a - end)
        end = max(end, b)
    idle += max(0.0, t0 + wall - end)
    return {"step": step, "wall_ms": wall / 1e3, "streams": streams,
            "compute_idle_ms": idle / 1e3}


def table(summary: dict, top: int) -> str:
    lines = [f"step {summary['step']}: wall {summary['wall_ms']:,.1f} ms; compute stream idle "
             f"{summary['compute_idle_ms']:,.1f} ms"]
    for stream, rows in summary["streams"].items():
        total = sum(r["total_ms"] for r in rows)
        lines.append(f"{stream}: {total:,.1f} ms in {sum(r['count'] for r in rows):,} spans")
        lines.append(f"  {'op':44s} {'count':>7s} {'total ms':>11s} {'of wall':>8s} "
                     f"{'mean us':>10s}")
        for r in rows[:top]:
            lines.append(f"  {r['op'][:44]:44s} {r['count']:7,d} {r['total_ms']:11,.1f} "
                         f"{r['share']:8.1%} {r['mean_us']:10,.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.trace_ops",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace JSON from dataflow-demo --trace")
    p.add_argument("--step", type=int, default=None, help="the step (default: the last traced)")
    p.add_argument("--top", type=int, default=20, help="op kinds shown per stream (default 20)")
    p.add_argument("--out", default="", help="write the summary as JSON here too")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top {args.top}: give at least 1")
    events, names = read_trace(Path(args.trace))
    summary = summarize(events, names, args.step)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
