"""Overlapped rounds on paper (issue 56: the next round's first layers start while this round
drains): how deep a ring may overlap its rounds within each rank's device budget, the step the
planner's model predicts for it, and the op-by-op simulation it is checked against
(dataflow.memplan.step.ring_overlap). Pure Python: never imports array libraries, never touches
a device; the predictions are a model, not measurements."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.step.ring_overlap import POLICIES, RingCosts, time_overlapped


def overlap_bytes_per_layer(rp: RankPlan) -> int:
    """Device bytes one local layer's forward of the next round adds while this round's
    saved activations still live on the rank: its chunks' device-resident saved activations
    (a round's device activations over the rank's layers) plus the round's two residual rows of
    transition (the residual and its gradient stay per round)."""
    plan = rp.plan
    mem = dict(plan.memory.device)
    acts = sum(v for k, v in mem.items() if "activation" in k)
    per_layer = acts // max(1, len(rp.layers))
    ch = plan.chunking
    transition = 2 * ch.chunk_tokens * ch.chunks_per_round * plan.model.model_dim * 2
    return per_layer + transition // max(1, len(rp.layers))


def overlap_depth(rp: RankPlan) -> int:
    """Local layers of the next round whose forward rank rp can run ahead of this round's
    backward: as many as its device budget holds beside the rank's plan and the libraries'
    reserve (at most all of them)."""
    plan = rp.plan
    free = plan.budget.device_bytes - plan.profile.library_reserve_bytes - plan.memory.device_bytes
    per = overlap_bytes_per_layer(rp)
    if free <= 0:
        return 0
    return min(len(rp.layers), free // per if per else len(rp.layers))


def ring_depth(rank_plans: tuple[RankPlan, ...]) -> int:
    """The ring's overlap depth: the room each rank was planned to leave for it
    (RankPlan.round_overlap) plus what its budget holds beside the plan, the smallest over the
    ranks (every rank runs the same depth so the schedule's messages match); 0 for a ring of
    one rank or one round a step."""
    if len(rank_plans) < 2 or rank_plans[0].plan.chunking.rounds_per_step < 2:
        return 0
    return min(min(len(rp.layers), rp.round_overlap + overlap_depth(rp)) for rp in rank_plans)


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
    make_rank_plans plans them, the bytes one overlapped layer holds taken from that (the
    largest rank's, overlap_bytes_per_layer), and planned again under the device budget less
    `depth` of them; every rank's RankPlan.round_overlap is `depth` (at most its layers).
    Raises what make_rank_plans raises (InfeasibleBudget where the smaller budget fits none)."""
    # ring_plan imports this module (predict_ring's overlap): imported here to avoid the cycle
    from dataflow.memplan.search.ring_plan import make_rank_plans

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"round overlap depth {depth!r}: use a whole number of local layers "
                         ">= 1 (0 is make_rank_plans' plain ring)")
    plain = make_rank_plans(cfg, seqlen, budget, profile, n_ranks, **constraints)
    depth = min(depth, min(len(rp.layers) for rp in plain))
    per = max(overlap_bytes_per_layer(rp) for rp in plain)
    room = budget.device_bytes - depth * per
    if room <= 0:
        raise ValueError(f"round overlap of {depth} layer(s) needs {depth * per / 2**30:.2f} GiB "
                         f"of the {budget.device_bytes / 2**30:.2f} GiB device budget")
    smaller = Budget(host_bytes=budget.host_bytes, device_bytes=room)
    plans = make_rank_plans(cfg, seqlen, smaller, profile, n_ranks, **constraints)
    return tuple(dataclasses.replace(rp, round_overlap=depth) for rp in plans)
