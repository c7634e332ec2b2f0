"""A traced step beside its simulation: reads a Chrome trace that `dataflow-demo --trace` wrote
(plain or .gz) and the run's plan (a plan JSON, or the demo's --json record holding it), times
the plan's compiled schedule of the same rounds (memplan.step.sim.simulate_schedule), and prints
per stream the copy and host op kinds (breakdown.op_key) with their count, summed time, bytes
and rate, measured beside simulated, then the step's wall and compute-busy time both ways. Made
for refitting the cost model: the rows that differ say which rate or overlap the model has wrong
(bench/records/s40/: the D2H link carried twice, the host's norm at a third of its time).

    python -m dataflow.bench.trace_vs_model t.json.gz run.json --step 3 --top 12 --out cmp.json

Compute is compared as the stream's busy time only (the simulation times a layer's forward or
backward of a chunk as one event, the trace each op). A deferred update is simulated inside
round 0, as a step after the first runs it. Pure Python; never touches a device."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from dataflow.bench.trace_ops import read_trace
from dataflow.instrument.breakdown import op_key
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import Plan
from dataflow.memplan.search.cost import event_seconds
from dataflow.memplan.step.compile import compile_schedule
from dataflow.memplan.step.sim import simulate_schedule


def read_plan(path: Path) -> Plan:
    """A plan JSON, or a dataflow-demo --json record's 'plan'."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not readable JSON ({exc})")
    doc = doc.get("plan", doc) if isinstance(doc, dict) else doc
    try:
        return Plan.from_json(json.dumps(doc))
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"{path}: neither a plan nor a run record holding one ({exc})")


def _rows(spans) -> dict:
    """(stream, op kind) -> [count, seconds, bytes] of (stream, name, start s, end s, bytes)."""
    out: dict = defaultdict(lambda: [0, 0.0, 0])
    for stream, name, a, b, nbytes in spans:
        row = out[(stream, op_key(name.split("(")[0]))]
        row[0] += 1
        row[1] += b - a
        row[2] += nbytes
    return out


def measured(events, names, step: int | None) -> tuple[int, float, list]:
    """(step, wall s, spans as simulate_schedule gives them) of one traced step."""
    steps = sorted({e["args"]["step"] for e in events if "step" in e.get("args", {})})
    if not steps:
        raise SystemExit("the trace holds no step's spans")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise SystemExit(f"--step {step}: the trace holds steps {steps}")
    spans = [e for e in events if e.get("args", {}).get("step") == step
             and not e["name"].startswith("step ") and names.get(e["tid"]) != "steps"]
    t0 = min(e["ts"] for e in spans)
    wall = max(e["ts"] + e["dur"] for e in spans) - t0
    return step, wall / 1e6, [(names.get(e["tid"], str(e["tid"])), e["name"], e["ts"] / 1e6,
                               (e["ts"] + e["dur"]) / 1e6, e["args"].get("bytes", 0))
                              for e in spans]


def compare(trace: Path, plan_path: Path, step: int | None = None) -> dict:
    """The measured and simulated rows of one step, and both steps' wall and compute busy."""
    events, names = read_trace(trace)
    step, wall, spans = measured(events, names, step)
    plan = read_plan(plan_path)
    d = decisions_of(plan)
    sch = compile_schedule(d, rounds=d.chunking.rounds_per_step, update="deferred")
    tl = simulate_schedule(sch, event_seconds(d, plan.profile), plan.profile, spans=True)
    meas, sim = _rows(spans), _rows(tl.spans)
    rows = []
    for key in set(meas) | set(sim):
        if key[0] == "compute":
            continue
        m, s = meas[key], sim[key]
        rows.append({"stream": key[0], "op": key[1], "count": [m[0], s[0]],
                     "ms": [m[1] * 1e3, s[1] * 1e3], "bytes": [m[2], s[2]],
                     "gb_per_s": [b / t / 1e9 if t and b else None
                                  for b, t in ((m[2], m[1]), (s[2], s[1]))]})
    rows.sort(key=lambda r: -max(r["ms"]))
    busy = sum(b - a for st, _, a, b, _ in spans if st == "compute")
    return {"step": step, "profile": plan.profile.name, "wall_s": [wall, tl.total_s],
            "compute_busy_s": [busy, tl.compute_busy_s], "rows": rows}


def table(c: dict, top: int) -> str:
    def rate(x):
        return f"{x:6.1f}" if x else "     -"

    lines = [f"step {c['step']} (profile {c['profile']}): wall {c['wall_s'][0]:.3f} s measured, "
             f"{c['wall_s'][1]:.3f} s simulated; compute busy {c['compute_busy_s'][0]:.3f} / "
             f"{c['compute_busy_s'][1]:.3f} s",
             f"  {'stream':6s} {'op':26s} {'count':>11s} {'ms measured':>11s} {'simulated':>9s} "
             f"{'GB/s meas':>9s} {'sim':>6s}"]
    for r in c["rows"][:top]:
        lines.append(f"  {r['stream']:6s} {r['op']:26s} {r['count'][0]:5d}/{r['count'][1]:<5d} "
                     f"{r['ms'][0]:11.1f} {r['ms'][1]:9.1f} {rate(r['gb_per_s'][0]):>9s} "
                     f"{rate(r['gb_per_s'][1])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.trace_vs_model",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("trace", type=Path, help="Chrome trace from dataflow-demo --trace (.json, .gz)")
    p.add_argument("plan", type=Path, help="the run's plan JSON, or its dataflow-demo --json record")
    p.add_argument("--step", type=int, default=None, help="step to compare (default: the last)")
    p.add_argument("--top", type=int, default=16, help="rows to print (default 16)")
    p.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here")
    a = p.parse_args(argv)
    c = compare(a.trace, a.plan, a.step)
    print(table(c, a.top))
    if a.out is not None:
        a.out.write_text(json.dumps(c, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
