"""The small ring the CPU ring tests plan: the CPU profile, 0.25 GiB budgets, 2 chunks of 128
tokens a round for 2 rounds, tiny with any number of layers, and the check that every rank's
sends meet the receives of their peers."""

from __future__ import annotations

import dataclasses

from dataflow.memplan import get_profile
from dataflow.memplan.plan import Budget
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
    from dataflow.memplan.ring_schedule import Recv, Send, compile_ring_schedule

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
