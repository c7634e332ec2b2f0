"""Overlapped rounds on paper (issue 56: the next round's first layers start while this round
drains): how deep a ring may overlap its rounds within each rank's budgets, the step the
planner's model predicts for it, and the op-by-op simulation it is checked against
(dataflow.memplan.step.ring_overlap). Pure Python: never imports array libraries, never touches
a device; the predictions are a model, not measurements."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.buffers import align
from dataflow.memplan.plan.memory import overlap_regions
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.step.ring_overlap import POLICIES, RingCosts, time_overlapped


def _acts_per_layer(rp: RankPlan, side: str) -> int:
    """A round's saved-activation bytes on `side` ('device' or 'host': those sent home) over the
    rank's layers: what one local layer's forward of the next round adds there."""
    acts = dict(getattr(rp.plan.memory, side)).get("saved_activations", 0)
    return acts // max(1, len(rp.layers))


def overlap_bytes(rp: RankPlan, depth: int) -> tuple[int, int]:
    """(device, host) bytes rank rp holds beyond its plan while `depth` local layers of the
    next round have run ahead of this round's backward. Device: the regions the executor
    allocates for it (dataflow.memplan.plan.memory.overlap_regions: a second set of a round's
    rows, the residual pair and tokens, and a second copy of each of the first `depth` layers'
    device-resident saved activations), or the estimate made before the overlap ran, if larger:
    `depth` times one layer's share of the round's device-resident saved activations (the mean
    over the rank's layers) plus the residual pair, which stands for what a plan whose layers
    stream (their saved activations through slots: not run overlapped yet) would need. Host:
    `depth` times one layer's share of the activations the plan sends home."""
    if depth <= 0:
        return 0, 0
    regions = sum(align(nb) for _, nb in overlap_regions(rp.plan, depth))
    ch = rp.plan.chunking
    pair = 2 * ch.chunk_tokens * ch.chunks_per_round * rp.plan.model.model_dim * 2
    estimate = depth * _acts_per_layer(rp, "device") + pair
    return max(regions, estimate), depth * _acts_per_layer(rp, "host")


def overlap_depth(rp: RankPlan) -> int:
    """Local layers of the next round rank rp can run ahead of this round's backward beyond the
    RankPlan.round_overlap its plan left room for: as many as its budgets hold beside the
    rank's plan and the libraries' reserve (at most all of them)."""
    plan, base = rp.plan, rp.round_overlap
    free_d = plan.budget.device_bytes - plan.profile.library_reserve_bytes - plan.memory.device_bytes
    free_h = plan.budget.host_bytes - plan.memory.host_bytes
    more = 0
    while base + more < len(rp.layers):
        dev, host = (a - b for a, b in zip(overlap_bytes(rp, base + more + 1),
                                           overlap_bytes(rp, base)))
        if dev > free_d or host > free_h:
            break
        more += 1
    return more


def ring_depth(rank_plans: tuple[RankPlan, ...]) -> int:
    """The ring's overlap depth: the room each rank was planned to leave for it
    (RankPlan.round_overlap) plus what its budget holds beside the plan, the smallest over the
    ranks (every rank runs the same depth so the schedule's messages match); 0 for a ring of
    one rank or one round a step."""
    if len(rank_plans) < 2 or rank_plans[0].plan.chunking.rounds_per_step < 2:
        return 0
    return min(min(len(rp.layers), rp.round_overlap) + overlap_depth(rp) for rp in rank_plans)


def ring_costs(rank_plans: tuple[RankPlan, ...], hop_s: float, vocab_s: float = 0.0,
               rounds: int | None = None) -> RingCosts:
    """The seconds of every op of the ring (the cost model's, as ring_round_s times them)."""
    # ring_plan imports this module (predict_ring's overlap): imported here to avoid the cycle
    from dataflow.memplan.search.ring_plan import _chunk_seconds, _owners

    owners = _owners(rank_plans)
    fwd = [()] * len(owners)
    bwd = [()] * len(owners)
    head = [0.0] * len(rank_plans)
    head_rank = rank_plans[-1].rank
    kinds: dict[tuple, tuple] = {}
    for rp in rank_plans:
        key = (id(rp.plan.activations), len(rp.layers), rp.has_embed, rp.has_head,
               rp.holds_head_block)
        if key not in kinds:
            kinds[key] = _chunk_seconds(rp)
        f, b, h, _ = kinds[key]
        for j, g in enumerate(rp.layers):
            fwd[g], bwd[g] = tuple(f), tuple(b[j])
        head[rp.rank] = h
        if rp.has_head:
            head_rank = rp.rank
    ch = rank_plans[0].plan.chunking
    return RingCosts(owners=owners, chunks=ch.chunks_per_round,
                     rounds=ch.rounds_per_step if rounds is None else rounds,
                     fwd_s=tuple(fwd), bwd_s=tuple(bwd), head_s=tuple(head),
                     head_rank=head_rank, vocab=rank_plans[0].vocab_parallel, vocab_s=vocab_s,
                     hop_s=hop_s)


MODEL_ROUNDS = 3
"""Rounds the model times op by op before it extrapolates: the first pays the ring's fill,
the later ones its steady period with the overlap."""


def overlap_policy(rank_plans: tuple[RankPlan, ...], hop_s: float, depth: int,
                   vocab_s: float = 0.0) -> tuple[str, float]:
    """(the fastest of POLICIES for this ring at `depth`, the model's seconds of its rounds):
    each policy's first MODEL_ROUNDS rounds timed op by op (simulate_overlap), the rest at the
    steady period of its later rounds, (T(m) - T(1)) / (m - 1); a step of at most MODEL_ROUNDS
    rounds is timed whole. The first policy on a tie."""
    rounds = rank_plans[0].plan.chunking.rounds_per_step
    m = min(rounds, MODEL_ROUNDS)
    t_1 = simulate_overlap(rank_plans, hop_s, 0, vocab_s, 1).step_s if m < rounds else 0.0
    best = None
    for policy in POLICIES:
        t_m = simulate_overlap(rank_plans, hop_s, depth, vocab_s, m, policy).step_s
        total = t_m if m == rounds else t_m + (rounds - m) * (t_m - t_1) / (m - 1)
        if best is None or total < best[1]:
            best = (policy, total)
    return best


def overlapped_rounds_s(rank_plans: tuple[RankPlan, ...], hop_s: float, depth: int,
                        vocab_s: float = 0.0) -> float:
    """The model of a step's rounds (compute and messages) with the next round's forward of
    each rank's first `depth` local layers run where the rank waits for this round's backward,
    at the fastest policy (overlap_policy). What the record (bench/records/s27-ring-overlap/)
    checks: that the period holds over a step's every round, against the whole step timed op
    by op at that policy."""
    return overlap_policy(rank_plans, hop_s, depth, vocab_s)[1]


def simulate_overlap(rank_plans: tuple[RankPlan, ...], hop_s: float, depth: int,
                     vocab_s: float = 0.0, rounds: int | None = None, policy: str = "wait"):
    """The op-by-op timing (dataflow.memplan.step.ring_overlap.time_overlapped) of the ring's
    rounds at `depth` (0: the plain ring) and `policy`: what the model is checked against."""
    return time_overlapped(ring_costs(rank_plans, hop_s, vocab_s, rounds), depth, policy)


OVERLAP_DEPTHS = (1, 2, 4, 8)
"""Overlap depths (local layers) the layout search weighs for a ring, each planned under the
device budget less what the overlapped layers' activations hold (a depth past the ranks'
layers is left out)."""
QUICK_OVERLAP_DEPTHS = (1, 4)
"""The same for a quick layout search (dataflow-plan's table over 2..64 GPUs)."""


def overlap_rank_plans(cfg, seqlen: int, budget, profile, n_ranks: int, depth: int,
                       **constraints) -> tuple[RankPlan, ...]:
    """The ring's rank plans with room for `depth` local layers of overlap: planned once as
    make_rank_plans plans them, the bytes the overlap holds taken from that (the largest
    rank's, overlap_bytes), and planned again under the budgets less those; every rank's
    RankPlan.round_overlap is `depth` (at most its layers).
    Raises what make_rank_plans raises (InfeasibleBudget where the smaller budget fits none)."""
    # ring_plan imports this module (predict_ring's overlap): imported here to avoid the cycle
    from dataflow.memplan.search.ring_plan import make_rank_plans

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"round overlap depth {depth!r}: use a whole number of local layers "
                         ">= 1 (0 is make_rank_plans' plain ring)")
    plain = make_rank_plans(cfg, seqlen, budget, profile, n_ranks, **constraints)
    depth = min(depth, min(len(rp.layers) for rp in plain))
    dev, host = (max(x) for x in zip(*(overlap_bytes(rp, depth) for rp in plain)))
    if dev >= budget.device_bytes or host >= budget.host_bytes:
        raise ValueError(f"round overlap of {depth} layer(s) needs {dev / 2**30:.2f} GiB device "
                         f"and {host / 2**30:.2f} GiB host of the {budget.device_bytes / 2**30:.2f}"
                         f" / {budget.host_bytes / 2**30:.2f} GiB budgets; try a smaller depth")
    smaller = Budget(host_bytes=budget.host_bytes - host, device_bytes=budget.device_bytes - dev)
    plans = make_rank_plans(cfg, seqlen, smaller, profile, n_ranks, **constraints)
    return tuple(dataclasses.replace(rp, round_overlap=depth) for rp in plans)
