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
import contextlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.sweep import git_commit
from dataflow.memplan import get_profile
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.ring_plan import (LINKS, RING_EFFICIENCY, make_rank_plans, predict_ring,
                                        ring_efficiency, ring_profile)
from dataflow.memplan.search.predict import simulate_ring
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

CASES = (("8b", 8192, (80, 24)), ("15b", 8192, (80, 24)), ("32b", 8192, (80, 24)),
         ("32b", 8192, (120, 40)), ("8b", 65536, (80, 24)))
"""(model, seqlen, (host GiB, device GiB) per device). 32b at 8k does not fit 80/24 per device
in small rings (its state is about 16 bytes a parameter: 32 layers of a ring of 2 hold some
250 GiB), so it is also checked at 120/40, where every N from 2 fits."""
RANKS = (2, 4, 8, 16, 32, 64)


@contextlib.contextmanager
def staged_ahead():
    """What if the ring compiler staged each round's tokens and embedding rows a round ahead, as
    the one-device compiler does (its stage_next)? memplan/step/ring_compile.py's RingCompiler
    overrides stage_next to stage them only when the round loads them, so the rank holding the
    embedding runs the last round's host scatter and this round's gather between rounds while
    the others wait. Swaps the hook for the duration (this process only); yields False, and
    changes nothing, once the ring compiler no longer overrides it."""
    from dataflow.memplan.step.compile import StepCompiler
    from dataflow.memplan.step.ring_compile import RingCompiler

    cls = RingCompiler
    if "stage_next" not in vars(cls):
        yield False
        return
    saved = cls.stage_next
    cls.stage_next = StepCompiler.stage_next
    try:
        yield True
    finally:
        cls.stage_next = saved


def plan_ring(cfg, seqlen: int, budget: Budget, profile, n: int, max_rounds: int | None):
    """(rank plans, note): the planner's chunking, or a full ring's where that leaves the ring
    under-full and a full one fits (memplan/search/layout.py _candidates); rounds capped if asked."""
    cap = {} if max_rounds is None else {"rounds_per_step": max_rounds}
    base = make_rank_plans(cfg, seqlen, budget, profile, n)
    ch = base[0].plan.chunking
    note = "planner"
    if ch.chunks_per_round < n:
        try:
            base = make_rank_plans(cfg, seqlen, budget, profile, n,
                                   chunks_per_round=math.lcm(ch.chunks_per_round, n))
            note = "full ring"
        except (ConfigError, ValueError):  # InfeasibleBudget included
            note = "under-full (a full ring does not fit)"
    if cap and base[0].plan.chunking.rounds_per_step > max_rounds:
        c = base[0].plan.chunking.chunks_per_round
        base = make_rank_plans(cfg, seqlen, budget, profile, n, chunks_per_round=c, **cap)
        note += f", rounds capped at {max_rounds}"
    return base, note


def check_one(model: str, seqlen: int, gib: tuple[float, float], n: int,
              max_rounds: int | None) -> dict:
    """One row: the model's and the simulation's tok/s for a ring of n, and where the
    simulated ranks wait."""
    cfg = load_config(model)
    budget = Budget.from_gib(*gib)
    profile = ring_profile(get_profile("h100"), n, "nccl")
    t0 = time.perf_counter()
    rps, note = plan_ring(cfg, seqlen, budget, profile, n, max_rounds)
    plan_s = time.perf_counter() - t0
    link = LINKS[0]
    t0 = time.perf_counter()
    pred = predict_ring(rps, link)
    model_s = time.perf_counter() - t0
    raw_step_s = pred.step_time_s * ring_efficiency(n, rps[0].plan.chunking.chunks_per_round)
    t0 = time.perf_counter()
    lines, step_s = simulate_ring(rps, link.bytes_per_s, link.latency_s)
    with staged_ahead():
        ahead_s = simulate_ring(rps, link.bytes_per_s, link.latency_s)[1]
    sim_s = time.perf_counter() - t0
    ch = rps[0].plan.chunking
    sim_tok = ch.tokens_per_step / step_s
    ahead_tok = ch.tokens_per_step / ahead_s
    raw_tok = ch.tokens_per_step / raw_step_s
    busiest = max(range(n), key=lambda r: lines[r].compute_busy_s)
    ranks = [{"rank": r, "layers": len(rps[r].layers), "embed": rps[r].has_embed,
              "head": rps[r].has_head, "own_step_s": rps[r].plan.prediction.step_time_s,
              "busy_s": lines[r].compute_busy_s, "total_s": lines[r].total_s,
              "waits_s": {k: v for k, v in lines[r].exposed_s.items() if v > 1e-6}}
             for r in range(n)]
    return {
        "model": model, "seqlen": seqlen, "host_gib": gib[0], "device_gib": gib[1],
        "n_ranks": n, "chunks_per_round": ch.chunks_per_round,
        "rounds_per_step": ch.rounds_per_step, "chunk_tokens": ch.chunk_tokens,
        "tokens_per_step": ch.tokens_per_step, "chunking": note,
        "model_tok_per_s": pred.tok_per_s, "model_raw_tok_per_s": raw_tok,
        "model_step_s": pred.step_time_s, "model_fill_s": pred.fill_s,
        "model_rank_step_s": pred.rank_step_time_s, "model_bubble_frac": pred.bubble_frac,
        "sim_tok_per_s": sim_tok, "sim_step_s": step_s,
        "sim_over_model": sim_tok / pred.tok_per_s, "sim_over_model_raw": sim_tok / raw_tok,
        "sim_staged_ahead_tok_per_s": ahead_tok,
        "sim_staged_ahead_over_model_raw": ahead_tok / raw_tok,
        "busiest_rank": busiest, "busiest_idle_frac": 1.0 - lines[busiest].compute_busy_s / step_s,
        "plan_s": plan_s, "model_s": model_s, "sim_wall_s": sim_s, "ranks": ranks}


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
          "RING_EFFICIENCY, and OVERFULL_RING_EFFICIENCY with more chunks a round than ranks); model raw: the same before those factors; sim: simulate_ring; "
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
                r = check_one(model, seqlen, gib, n, args.max_rounds)
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
                  "refused": notes}
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
