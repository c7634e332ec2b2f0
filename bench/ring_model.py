"""The ring-model check's planner half (issue 38, "one model, checked"): the analytical ring model
(`memplan.ring_plan.predict_ring`, what the layout chooser weighs) against the simulation of
every rank's compiled schedule timed together (`memplan.search.predict.simulate_ring`), one row
per ring, planned as the layout chooser plans it. bench/ring_model_check.py is its command line
(table and JSON record). Pure planner: never imports array libraries or psutil, never touches a
device, so a planner test can import it."""

from __future__ import annotations

import contextlib
import math
import time

from dataflow.memplan import get_profile
from dataflow.memplan.step.compile import StepCompiler
from dataflow.memplan.step.ring_compile import RingCompiler
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.ring_plan import (LINKS, make_rank_plans, predict_ring, ring_efficiency,
                                        ring_profile)
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


def plan_ring(cfg, seqlen: int, budget: Budget, profile, n: int, max_rounds: int | None,
              vocab_parallel: bool = False):
    """(rank plans, note): the planner's chunking, or a full ring's where that leaves the ring
    under-full and a full one fits (memplan/search/layout.py _candidates); rounds capped if asked.
    vocab_parallel: every rank a shard of the head (RankPlan.vocab_parallel)."""
    cap = {} if max_rounds is None else {"rounds_per_step": max_rounds}
    vp = {"vocab_parallel": True} if vocab_parallel else {}
    base = make_rank_plans(cfg, seqlen, budget, profile, n, **vp)
    ch = base[0].plan.chunking
    note = "planner"
    if ch.chunks_per_round < n:
        try:
            base = make_rank_plans(cfg, seqlen, budget, profile, n,
                                   chunks_per_round=math.lcm(ch.chunks_per_round, n), **vp)
            note = "full ring"
        except (ConfigError, ValueError):  # InfeasibleBudget included
            note = "under-full (a full ring does not fit)"
    if cap and base[0].plan.chunking.rounds_per_step > max_rounds:
        c = base[0].plan.chunking.chunks_per_round
        base = make_rank_plans(cfg, seqlen, budget, profile, n, chunks_per_round=c, **cap, **vp)
        note += f", rounds capped at {max_rounds}"
    return base, note


def check_one(model: str, seqlen: int, gib: tuple[float, float], n: int,
              max_rounds: int | None, vocab_parallel: bool = False) -> dict:
    """One row: the model's and the simulation's tok/s for a ring of n (with vocab_parallel,
    its head split over the vocabulary), and where the simulated ranks wait."""
    cfg = load_config(model)
    budget = Budget.from_gib(*gib)
    profile = ring_profile(get_profile("h100"), n, "nccl")
    t0 = time.perf_counter()
    rps, note = plan_ring(cfg, seqlen, budget, profile, n, max_rounds, vocab_parallel)
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
        "vocab_parallel_head": bool(vocab_parallel),
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
