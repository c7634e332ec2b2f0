"""One model, checked (issue 38): the analytical ring model (`memplan.ring_plan.predict_ring`,
what the layout chooser weighs) against the simulation of every rank's compiled schedule timed
together (`memplan.ring_schedule.simulate_ring`), for rings of N = 2 ... 64 of 8b, 15b and 32b at
8k and 8b at 64k on the H100 profile over NVLink. Pure planner: no GPU, no arrays; prints a table
and writes a JSON record.

    python -m dataflow.bench.ring_model_check \
        --out bench/records/s16-ring-model-check/ring_model_check.json

Each ring is planned as the layout chooser plans it: every rank under the per-device budgets
with NCCL's device memory reserved (ring_profile), the planner's chunking, or a full ring's
(a multiple of N chunks a round) where the planner's leaves the ring under-full and a full one
fits. Both the model's prediction (with RING_EFFICIENCY, the measured correction the simulation
does not contain) and the model before that factor are reported."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dataflow.bench.ring_model import CASES, RANKS, check_one
from dataflow.bench.sweep.sweep import git_commit
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.search.ring_plan import LINKS, RING_EFFICIENCY
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError


def row_text(r: dict) -> str:
    return (f"{r['model']:>4} {r['seqlen']:>6} {r['n_ranks']:>3} "
            f"{r['host_gib']:g}/{r['device_gib']:g}".ljust(24)
            + f"{r['chunks_per_round']:>3} x {r['rounds_per_step']:<4}"
            f"{r['model_tok_per_s']:>10,.0f} {r['model_raw_tok_per_s']:>10,.0f} "
            f"{r['sim_tok_per_s']:>10,.0f} {r['sim_over_model']:>7.3f} "
            f"{r['sim_over_model_raw']:>7.3f} {r['sim_staged_ahead_tok_per_s']:>10,.0f} "
            f"{r['sim_staged_ahead_over_model_raw']:>7.3f} {r['busiest_idle_frac']:>7.1%} "
            f"{r['sim_wall_s']:>7.1f}  {r['chunking']}")


HEADER = (f"{'model':>4} {'seqlen':>6} {'N':>3} {'host/dev':<10}"
          f"{'C x rounds':<11}{'model':>10} {'model raw':>10} {'sim':>10} {'sim/mod':>7} "
          f"{'sim/raw':>7} {'sim ahead':>10} {'/raw':>7} {'idle':>7} {'sim s':>7}  chunking")
LEGEND = ("tok/s over NVLink (150 GB/s, 10 us), H100 profile. model: predict_ring (with "
          "RING_EFFICIENCY, and OVERFULL_RING_EFFICIENCY with more chunks a round than ranks); "
          "model raw: the same before those factors; sim: simulate_ring; "
          "sim ahead: simulate_ring with the ring compiler staging each round's host work a round "
          "ahead (staged_ahead); idle: the busiest simulated rank's idle share of the step (sim); "
          "sim s: seconds to simulate both.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataflow.bench.ring_model_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the JSON record here (and the table beside "
                    "it, .txt)")
    ap.add_argument("--models", default="8b,15b,32b,8b@65536",
                    help="cases to check: model or model@seqlen, comma-separated (every budget "
                         "of CASES for it)")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--vocab-parallel-head", action="store_true",
                    help="plan every ring with its head split over the vocabulary "
                         "(RankPlan.vocab_parallel)")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="cap rounds per step (rounds_per_step) to shorten large simulations")
    args = ap.parse_args(argv)
    wanted = [(m.split("@")[0], int(m.split("@")[1]) if "@" in m else 8192)
              for m in args.models.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    rows, notes, lines = [], [], [LEGEND, HEADER]
    print(LEGEND, file=sys.stderr)
    print(HEADER, file=sys.stderr)
    t_all = time.perf_counter()
    for model, seqlen, gib in CASES:
        if (model, seqlen) not in wanted:
            continue
        label = f"{model} {seqlen} at {gib[0]:g}/{gib[1]:g}"
        n_layers = load_config(model).n_layers
        for n in (n for n in ranks if n <= n_layers):
            try:
                r = check_one(model, seqlen, gib, n, args.max_rounds,
                              args.vocab_parallel_head)
            except (ConfigError, InfeasibleBudget) as exc:
                msg = f"{label} N={n}: refused by the planner: {str(exc).split(';')[0][:140]}"
                notes.append(msg)
                lines.append(msg)
                print(msg, file=sys.stderr)
                continue
            rows.append(r)
            lines.append(row_text(r))
            print(lines[-1], file=sys.stderr, flush=True)
    total_s = time.perf_counter() - t_all
    lines.append(f"checked in {total_s:.0f} s")
    print(lines[-1], file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        record = {"what": "ring_model_check", "commit": head, "tree": git_commit(),
                  "profile": "h100",
                  "link": LINKS[0].name, "link_bytes_per_s": LINKS[0].bytes_per_s,
                  "link_latency_s": LINKS[0].latency_s, "ring_efficiency": RING_EFFICIENCY,
                  "max_rounds": args.max_rounds, "wall_s": total_s, "rows": rows,
                  "vocab_parallel_head": args.vocab_parallel_head,
                  "refused": notes}
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
