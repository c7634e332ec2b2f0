"""Overlapped rounds checked (issue 56): the planner's model of a ring's rounds with the next
round's first layers run during each round's drain (`memplan.search.ring_overlap.
overlap_policy`: three rounds timed op by op at each ordering policy, the rest extrapolated
at their period, the fastest policy kept)
against the whole step timed op by op (`simulate_overlap`, every round), for 20 rings, dense and
vocabulary-parallel, N = 2..8, several chunkings and overlap depths, on the H100 profile over
NVLink. Pure planner: no GPU, no arrays; prints a table and writes a JSON record.

    python -m dataflow.bench.ring_overlap_check \
        --out bench/records/s27-ring-overlap/overlap_check.json

Rounds (compute and messages) only: the step's other parts (exposed copies, the optimizer)
are the same with and without the overlap and are left out of both sides."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.ring_overlap import overlap_policy, simulate_overlap
from dataflow.memplan.search.ring_plan import (LINKS, make_rank_plans, ring_profile,
                                               ring_round_s, vocab_exchange_s)
from dataflow.models.hf_config import model_config

TOLERANCE = 0.05
"""How far the model may be from the op-by-op timing of the whole step."""


@dataclasses.dataclass(frozen=True, slots=True)
class OverlapRing:
    """One ring of the record: a model at 8k on per-device budgets, its chunking fixed."""

    model: str
    host_gb: float
    dev_gb: float
    n_ranks: int
    chunks: int
    rounds: int
    depth: int
    vocab: bool = False
    chunk_tokens: int = 8192

    @property
    def name(self) -> str:
        return (f"{self.model} {self.host_gb:g}/{self.dev_gb:g} N={self.n_ranks} C={self.chunks}"
                f" R={self.rounds} depth={self.depth}{' vocab' if self.vocab else ''}"
                f"{'' if self.chunk_tokens == 8192 else f' chunk={self.chunk_tokens}'}")


RINGS = (
    OverlapRing("1b", 60, 24, 2, 2, 8, 1), OverlapRing("1b", 60, 24, 2, 4, 6, 8),
    OverlapRing("1b", 60, 24, 2, 2, 10, 8, vocab=True),
    OverlapRing("1b", 30, 24, 4, 4, 6, 1), OverlapRing("1b", 30, 24, 4, 4, 8, 4),
    OverlapRing("1b", 30, 24, 4, 8, 6, 2, vocab=True),
    OverlapRing("1b", 30, 24, 4, 4, 6, 4, vocab=True),
    OverlapRing("8b", 60, 24, 2, 2, 8, 1), OverlapRing("8b", 60, 24, 2, 4, 6, 16),
    OverlapRing("8b", 60, 24, 2, 2, 6, 4, vocab=True),
    OverlapRing("8b", 30, 24, 4, 4, 8, 1), OverlapRing("8b", 30, 24, 4, 4, 6, 8),
    OverlapRing("8b", 30, 24, 4, 4, 8, 2, vocab=True),
    OverlapRing("8b", 30, 24, 4, 8, 6, 8, vocab=True, chunk_tokens=4096),
    OverlapRing("8b", 30, 24, 3, 3, 6, 2), OverlapRing("8b", 30, 24, 3, 6, 6, 4, vocab=True),
    OverlapRing("8b", 20, 24, 8, 8, 6, 1), OverlapRing("8b", 20, 24, 8, 8, 6, 4),
    OverlapRing("8b", 20, 24, 8, 8, 6, 2, vocab=True),
    OverlapRing("8b", 20, 24, 8, 16, 6, 4, vocab=True, chunk_tokens=4096),
)
"""20 rings. Their depths are given, not what the budgets leave (the check is of the model of
a schedule, whatever its depth); the plans are those the planner makes at the chunking."""


def check(ring: OverlapRing) -> dict:
    """The model's and the op-by-op timing's rounds of one ring, overlapped and in turn."""
    cfg, link = model_config(ring.model), LINKS[0]
    prof = ring_profile(get_profile("h100"), ring.n_ranks, "nccl")
    rps = make_rank_plans(cfg, 8192, Budget.from_gib(ring.host_gb, ring.dev_gb), prof,
                          ring.n_ranks, vocab_parallel=ring.vocab,
                          chunks_per_round=ring.chunks, chunk_tokens=ring.chunk_tokens,
                          rounds_per_step=ring.rounds)
    ch = rps[0].plan.chunking
    if (ch.chunks_per_round, ch.rounds_per_step) != (ring.chunks, ring.rounds):
        raise ValueError(f"{ring.name}: planned as {ch.chunks_per_round} x {ch.rounds_per_step}")
    hop = ch.chunk_tokens * cfg.model_dim * 2 / link.bytes_per_s + link.latency_s
    vocab_s = vocab_exchange_s(rps[0], link) if ring.vocab else 0.0
    round_s, _ = ring_round_s(rps, hop, vocab_s)
    policy, model = overlap_policy(rps, hop, ring.depth, vocab_s)
    sim = simulate_overlap(rps, hop, ring.depth, vocab_s, policy=policy)
    plain = simulate_overlap(rps, hop, 0, vocab_s).step_s
    return {"ring": ring.name, **dataclasses.asdict(ring), "model_s": model, "sim_s": sim.step_s,
            "error": model / sim.step_s - 1.0, "plain_model_s": ring.rounds * round_s,
            "plain_sim_s": plain, "gain": plain / sim.step_s - 1.0, "hoisted": sim.hoisted,
            "policy": policy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataflow.bench.ring_overlap_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    rows, t0 = [], time.time()
    print(f"{'ring':<46} {'model s':>9} {'sim s':>9} {'error':>7} {'in turn s':>9} {'gain':>6} "
          "policy")
    for ring in RINGS:
        row = check(ring)
        rows.append(row)
        print(f"{row['ring']:<46} {row['model_s']:>9.3f} {row['sim_s']:>9.3f} "
              f"{row['error']:>+7.1%} {row['plain_sim_s']:>9.3f} {row['gain']:>+6.1%} "
              f"{row['policy']}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.2%} (tolerance {TOLERANCE:.0%}); {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tolerance": TOLERANCE, "link": LINKS[0].name, "profile": "h100",
                       "rings": rows}, f, indent=1, sort_keys=True)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
