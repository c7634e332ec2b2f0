"""The final figures of memplan.search.layout's multi-GPU layouts: which of each layout's
candidates the search's estimates rank best, and, for replicas of one device, those predicted
again from their compiled schedules (predict_schedule, as one device's final prediction and
bench.budget_truth's are), as is the one device the speedups are against. Pure Python: never
imports array libraries, never touches a device."""

from __future__ import annotations

from dataflow.memplan.search.predict import predict_schedule

RESCORED = 3
"""Candidates of a layout of replicas of one device that the search's estimates rank best and
whose compiled schedules then predict them again (choose_layout): the search's per-round
estimate charges the deferred update whole, so it misranks plans of few rounds a step (the
replicas of a capped global batch). A rank of a ring of two or more alone exposes its first
fetches, which the ring's fill hides (8b, ring of 4, 2 rounds: 1.782 s compiled against 1.709),
so rings keep the ring model on the search's estimates. Counted within each resident-layer cap
(a 'max_resident_layers' constraint, layout_chunkings.fewer_resident_shapes): the estimate
misranks the caps against each other too, the same way (8b at 80 / 24 as one of 64 split
replicas: no resident layer 2.100 s estimated, 1.967 s compiled; 8 resident 1.998 and 2.049)."""


def best_of_each(options, merit, again) -> dict:
    """The best option of each layout (ring size, replicas) by `merit`, the first of equals; for
    replicas of one device among the RESCORED best by merit of each resident-layer cap, each
    predicted `again` (compiled)."""
    groups: dict[tuple[int, int], list] = {}
    for o in options:
        groups.setdefault((o.layout.ring_size, o.layout.replicas), []).append(o)
    best: dict[tuple[int, int], object] = {}
    for key, group in groups.items():
        if key[0] > 1:
            best[key] = max(group, key=merit)
            continue
        caps: dict[object, list] = {}
        for o in sorted(group, key=merit, reverse=True):
            caps.setdefault(dict(o.constraints).get("max_resident_layers"), []).append(o)
        for o in (o for cap in caps.values() for o in cap[:RESCORED]):
            o = again(o)
            if key not in best or merit(o) > merit(best[key]):
                best[key] = o
    return best


def compiled_tok_per_s(plan) -> float:
    """One device's tok/s as its compiled schedule predicts it (what the layouts' figures are
    compared with)."""
    return predict_schedule(plan, plan.profile).tok_per_s
