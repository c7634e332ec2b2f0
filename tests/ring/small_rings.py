"""The small ring the CPU ring tests plan: the CPU profile, 0.25 GiB budgets, 2 chunks of 128
tokens a round for 2 rounds, tiny with any number of layers, the check that every rank's
sends meet the receives of their peers, and a lone rank (a ring of 1) with every block at
home."""

from __future__ import annotations

import dataclasses

from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import load_config

CPU = get_profile("cpu")
BUDGET = Budget.from_gib(0.25, 0.25)
CHUNKING = dict(chunk_tokens=128, chunks_per_round=2, rounds_per_step=2)


def tiny_with(n_layers: int, *, name: str | None = None):
    """tiny with `n_layers` layers (named `name`, else tiny's own name)."""
    cfg = load_config("tiny")
    return dataclasses.replace(cfg, name=name or cfg.name, n_layers=n_layers)


def sends_pair_with_receives(plans) -> int:
    """Across the ranks' compiled schedules each Send(tag) to rank p is a Recv(tag) from the
    sender on p, in the same order per (sender, receiver) pair, with equal byte counts; returns
    the number of sends."""
    from dataflow.memplan.step.ring_compile import Recv, Send, compile_ring_schedule

    n = len(plans)
    scheds = [compile_ring_schedule(rp) for rp in plans]
    for src in range(n):
        for dst in range(n):
            sent = [(e.tag, e.src.nbytes) for e in scheds[src].events
                    if type(e) is Send and e.peer == dst]
            got = [(e.tag, e.dst.nbytes) for e in scheds[dst].events
                   if type(e) is Recv and e.peer == src]
            assert sent == got, (src, dst)
    return sum(type(e) is Send for s in scheds for e in s.events)


def lone_rank(cfg, be, *, seed: int = 0):
    """A RingRank of a ring of 1 on backend `be` (over the shared-memory transport, its segments
    unlinked once made), every block's weights, grads and AdamW state at home, one 64-token
    chunk a round."""
    import uuid

    from dataflow.memplan.plan.plan import OptimizerWhere
    from dataflow.memplan.plan.ranks import RankPlan
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport, cleanup
    from tests.dataflow.plans import forced_plan, streamed

    home = streamed(OptimizerWhere.HOST)
    plan = forced_plan(cfg, 64, chunk_tokens=64, layers=(home,) * cfg.n_layers, embed=home,
                       head=home, head_sub_tokens=64)
    rp = RankPlan(rank=0, n_ranks=1, layers=tuple(range(cfg.n_layers)), has_embed=True,
                  has_head=True, n_layers=cfg.n_layers, plan=plan)
    run_id = uuid.uuid4().hex[:12]
    try:
        tr = SharedMemoryTransport(0, 1, run_id, replica=0, replicas=1, timeout_s=120)
        return RingRank(rp, be, tr, seed=seed)
    finally:
        cleanup(run_id)
