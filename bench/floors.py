"""How far a better schedule alone could take a measured step. From a run's JSON (`dataflow.cli.demo
--json`, or dataflow.bench.budget_truth's `*.demo.json`) the last step's breakdown gives three ceilings,
at the kernel rates that very run measured (clocks, power cap and all):

  - no stalls: every copy, host call and bubble hidden (tokens / compute busy);
  - no recompute: that, and every saved activation kept whatever the memory it needs
    (tokens / (compute busy - recompute));
  - attention alone: the step's fused attention, forward and backward, recompute left out
    (tokens / attention time): at long context the part no schedule shortens.

A target above the no-recompute ceiling needs faster kernels, not another plan. Reads records
only (no GPU); prints a table and writes a JSON record.

    python -m dataflow.bench.floors bench/records/s13-h100-6b7f5ac/bt/8b-s131072-h120-d24.demo.json:3400

Records older than StepBreakdown.attention_s take the attention time from the run's log beside
the JSON (its last "largest compute costs" line: the five largest ops, so the figure is a lower
bound on the attention time when attention is not among the five largest ops)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.sweep import git_commit
from dataflow.instrument.breakdown import ceilings, is_attention, is_level_recompute

_COSTS = re.compile(r"largest compute costs(?: \(last step\))?: (.*)$", re.M)
"""The demo's line: once at the end in older logs, after every step since the twentieth
session ("step 2: largest compute costs: b.attention_bwd 1,234.5 ms (16x), ...")."""
_OP = re.compile(r"([\w.]+) ([\d.,]+) ms")


def _log_of(path: Path) -> Path:
    """The run's log beside its JSON: X.demo.json -> X.log (budget_truth), X.json -> X.log."""
    name = path.name
    stem = name[:-len(".demo.json")] if name.endswith(".demo.json") else path.stem
    return path.with_name(stem + ".log")


def attention_from_log(text: str) -> float | None:
    """Seconds of non-recompute attention among a log's "largest compute costs" ops (the
    forward's 'f.attention_*', the backward's 'b.attention_bwd*'), or None without that line."""
    m = None
    for m in _COSTS.finditer(text):
        pass  # the last step's line
    if m is None:
        return None
    # the same classification as compute_breakdown's attention_s: the backward's re-run
    # forward attention is recompute
    return sum(float(ms.replace(",", "")) / 1e3 for name, ms in _OP.findall(m.group(1))
               if is_attention(name) and not is_level_recompute(name))


def floors(run: dict, log_text: str | None = None) -> dict:
    """The ceilings of one run's last step (see the module docstring)."""
    step = run["steps"][-1]
    bd = step.get("breakdown") or {}
    if not bd:
        raise ValueError("the run's last step has no breakdown (was it traced? dataflow.cli.demo "
                         "--json records one per step)")
    tokens, busy, recompute = step["tokens"], bd["compute_busy_s"], bd["recompute_s"]
    attention, source = bd.get("attention_s", 0.0), "breakdown"
    if not attention and log_text is not None:
        from_log = attention_from_log(log_text)
        if from_log:
            attention, source = from_log, "log: five largest ops"
    plan = run.get("plan") or {}
    ceil = ceilings(tokens, busy, recompute, attention)
    return {
        "cell": _cell(plan), "tokens": tokens, "wall_s": bd["wall_s"],
        "measured_tok_s": step["tok_per_s"], "compute_busy_s": busy, "recompute_s": recompute,
        "attention_s": attention or None, "attention_source": source if attention else None,
        "setup_s": (run.get("setup") or {}).get("init_s"),
        "no_stalls_tok_s": ceil["no_stalls"], "no_recompute_tok_s": ceil["no_recompute"],
        "no_recompute_step_s": busy - recompute, "attention_alone_tok_s": ceil["attention_alone"],
    }


def _cell(plan: dict) -> str:
    try:
        gib = 2**30
        b = plan["budget"]
        return (f"{plan['model']['name']} at {plan['chunking']['seqlen']:,} "
                f"({b['host_bytes'] / gib:g}/{b['device_bytes'] / gib:g})")
    except (KeyError, TypeError):
        return "?"


def _verdict(row: dict, target: float | None) -> str:
    if target is None:
        return ""
    if row["measured_tok_s"] >= target:
        return "met"
    if row["no_recompute_tok_s"] < target:
        return "needs faster kernels"
    if row["no_stalls_tok_s"] < target:
        return "needs less recompute (memory) or faster kernels"
    return "a better schedule could reach it"


def _spec(text: str) -> tuple[Path, float | None]:
    """FILE or FILE:TARGET (tok/s)."""
    head, sep, tail = text.rpartition(":")
    if sep and re.fullmatch(r"\d+(\.\d+)?", tail):
        return Path(head), float(tail)
    return Path(text), None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN.json[:TARGET]",
                    help="a run's JSON, optionally with the tok/s a target asks")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    a = ap.parse_args(argv)

    rows = []
    for spec in a.runs:
        path, target = _spec(spec)
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"dataflow.bench.floors: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        log = _log_of(path)
        try:
            row = floors(run, log.read_text() if log.exists() else None)
        except (KeyError, IndexError, ValueError) as exc:
            print(f"dataflow.bench.floors: {path} is not a run record with a step breakdown ({exc})",
                  file=sys.stderr)
            return 2
        row.update(run=str(path), target_tok_s=target, verdict=_verdict(row, target))
        rows.append(row)

    def num(v, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v)

    print(f"{'cell':28s} {'measured':>9s} {'no stalls':>9s} {'no recomp':>9s} {'attention':>10s}"
          f" {'target':>7s} {'floor+setup s':>13s}  verdict")
    for r in rows:
        partial = "*" if r["attention_source"] not in (None, "breakdown") else " "
        setup = (None if r["setup_s"] is None else r["no_recompute_step_s"] + r["setup_s"])
        print(f"{r['cell']:28s} {num(r['measured_tok_s']):>9s} {num(r['no_stalls_tok_s']):>9s} "
              f"{num(r['no_recompute_tok_s']):>9s} {num(r['attention_alone_tok_s']):>9s}{partial} "
              f"{num(r['target_tok_s']):>7s} {num(setup, '{:,.1f}'):>13s}  {r['verdict']}")
    print("(tok/s; ceilings at the kernel rates each run measured: no stalls = compute busy "
          "only, no recompute = also without recompute, attention = its attention alone, * = "
          "from the log's five largest ops, so a ceiling too high where some attention op is not "
          "among them; floor+setup = the no-recompute step plus the run's set-up, seconds)")
    if a.out:
        rec = {"bench": "floors", "commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "rows": rows}
        Path(a.out).write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
