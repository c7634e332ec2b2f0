"""The ring on paper: which layers rank r of N owns (layer i on rank i mod N; the embedding on the
rank of layer 0, the head on the rank of layer L-1), the per-device plan of each rank (a plan of
the rank's own layers under per-device budgets, every rank sharing one chunking), and a model of
ring throughput for N = 2..64 over a few link kinds. Pure Python: never imports array libraries,
never touches a device; the predictions are a model, not measurements."""

from __future__ import annotations

import dataclasses
import math

from dataflow.memplan.plan.chunking import head_sub_tokens
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import AttentionBwd, Budget, GradAccum, HardwareProfile, Plan
from dataflow.memplan.plan.ranks import (
    Placement,
    RankPlan,
    check_ring,
    embed_rank,
    head_rank,
    layer_owners,
    moe_routing_chain,
    owned_layers,
    parse_placement,
    rank_model,
    refuse_vocab_parallel,
)
from dataflow.memplan.search.cost import LEVEL_INDEX, chunk_costs, head_seconds, workload_of
from dataflow.memplan.search.ring_overlap import (overlap_rank_plans, overlapped_rounds_s,
                                                  ring_depth)
from dataflow.memplan.search.search import make_plan
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

NCCL_RESERVE_BYTES = 1 << 30
"""Device memory NCCL holds in each process of a ring of two processes beside the arena and the
libraries (communicator buffers, proxy state, the transport's staging): measured 1.00 GiB per
process on 2 H200s over NVLink (3 communicators: world and the two directed pairs; 8b at 60/24,
bench/records/ring-h200x2-d3a8afd/), which the plans did not count. Part of the device budget."""

NCCL_RESERVE_4_BYTES = 7 << 28
"""The same with four processes: 1.75 GiB. A ring of 4 (8b at 30/24 on 4 H200s) ran 0.75 GiB
past plans that reserved NCCL_RESERVE_BYTES, at 433e71d and again at b008438
(bench/records/s16-ring-h200x4-b008438/): each process's world communicator and its pairs now
reach three other GPUs. Worlds of 3 take the mean of the two; worlds past 4 are assumed to need
no more than 4 (not measured: no machine with more GPUs has run a ring yet)."""


def nccl_reserve_bytes(processes: int) -> int:
    """NCCL's device memory per process in a world of `processes` (measured at 2 and 4)."""
    if processes < 2:
        return 0
    if processes == 2:
        return NCCL_RESERVE_BYTES
    if processes == 3:
        return (NCCL_RESERVE_BYTES + NCCL_RESERVE_4_BYTES) // 2
    return NCCL_RESERVE_4_BYTES


RINGS_OF_ONE_RESERVE_BYTES = (1 << 30) + (128 << 20) - (400 << 20)
"""NCCL's device memory per process of 2 data-parallel replicas (rings of 1, 2 processes), in
place of NCCL_RESERVE_BYTES + REPLICA_RESERVE_BYTES: their one communicator is the world
(ring/nccl.py), and 2 replicas of 8b at 60/24 on 2 H200s then ran 0.52 GiB under a plan that
reserved the two (bench/records/s19-h200x2-412dfa2/, against -0.04 GiB with two communicators in
s19-ring-h200x2-cfef615/); 0.4 GiB of it given back, 0.12 GiB kept as margin. Measured for 2
processes only; 4 and 8 keep the larger reserve."""

REPLICA_RESERVE_BYTES = 128 << 20
"""Device memory of the replicas' all-reduce beside NCCL_RESERVE_BYTES: the 64 MiB staging
buffer a home gradient is all-reduced through (ring/nccl.py REDUCE_STAGE_BYTES) and the replica
communicator's buffers. Measured: 2 data-parallel replicas of 8b at 60/24 on 2 H200s ran 0.10 GiB
past a plan that reserved NCCL_RESERVE_BYTES only (bench/records/s16-ring-h200x2-214ea68/)."""

RING_EFFICIENCY = 0.95
"""Measured ring throughput over the model's, after the single-device model's own error (one
H200 runs 2-3 % above its plan's prediction). With predict_ring's critical-path walk (74ff21d),
before this factor: a ring of 2 of 8b at 60/24 on 2 H200s (s16-ring-h200x2-214ea68) at 0.997,
a full ring of 4 at 30/24 on 4 H200s (s16-ring-h200x4-893d3ce) at 0.906; their mean is 0.95
(NCCL kernels sharing the SMs and what else the walk leaves out). The prediction of a ring of
two or more ranks is scaled by it; data parallelism (rings of 1) is not."""

OVERFULL_RING_EFFICIENCY = 0.92
"""A further factor for rings given more chunks a round than ranks, measured on machines of one
kind (4 H100s, this session's calls F, G and I): 8b at 30/24 on a ring of 4 ran 0.805 of the
model with 8 chunks of 8k a round (s17-ring-h100x4-92311e8) and 0.838 with 8 of 4k
(s17-ring-h100x4-1644192), against 0.894 with 4 of 4k (s17-ring-h100x4-cc8d78a): 8 chunks ran
0.92 of what 4 did, relative to the model. simulate_ring agrees with the model for those rings
(8b 4k x 8: 29,930 against 30,064 tok/s), and one H100 with the same chunks ran 0.92-1.04 of
its own plan, so the loss is in how the ring runs the extra chunks on the GPUs (twice the
messages in flight; not profiled yet). Every ring on those H100 machines ran 0.80-0.89 of the
model, where rings of N chunks on H200 machines had run 0.98 (s16): that shortfall is not
explained and RING_EFFICIENCY is left as measured on the H200s."""


def ring_efficiency(n_ranks: int, chunks_per_round: int) -> float:
    """What predict_ring divides a ring's step by: 1 for one rank (data parallelism),
    RING_EFFICIENCY for a ring, times OVERFULL_RING_EFFICIENCY where a round has more chunks
    than the ring has ranks."""
    if n_ranks < 2:
        return 1.0
    return RING_EFFICIENCY * (OVERFULL_RING_EFFICIENCY if chunks_per_round > n_ranks else 1.0)


SHARED_HOST_COPY_EFFICIENCY = 0.87
"""The host <-> device rate one GPU's offload gets while the other GPUs of its host stream too,
over its rate alone. The engine's own copies (both directions at once, as a step moves them),
8b at 60/24 with 16 rounds, one GPU alone against two at once on one machine:
on 2 H100s H2D 47.3-48.0 -> 40.6-42.3 GB/s and D2H 46.5-47.8 -> 39.9-42.1 (0.87; one alone
15.4-15.6 s a step, each of 2 replicas 17.2 s: exposed copy 15 % -> 23 %, the all-reduce's
wait 1 %; bench/records/s18-ring-h100x2-77ade76/); on 2 H200s H2D 0.89, D2H 0.92
(s18-ring-h200x2-63164c4/). bench.pcie_shared's plain copies show it too: each direction alone
keeps its rate with both GPUs copying, both directions at once drop to 0.81 (H100) and 0.73
(H200) of a GPU's alone. Measured for 2 GPUs; 4 and 8 GPUs of one host are assumed no worse
(not measured: the 4-GPU kinds were withdrawn before the call)."""


def ring_profile(profile: HardwareProfile, processes: int, transport: str,
                 replicas: int = 1) -> HardwareProfile:
    """The profile a rank plans with: the device budget also holds NCCL's memory when the ring
    runs over NCCL with more than one process, and with replicas the all-reduce's staging too (a
    GPU profile only: the NumPy backend's device is host memory, and the shared-memory transport
    stages in pinned host memory); and with more than one process on GPUs, each GPU's copies
    run at SHARED_HOST_COPY_EFFICIENCY of its rate alone (the processes of a launch share one
    host's PCIe and memory). The replicas' weight-part gathers (RankPlan.split_fetch) use the
    all-reduce's communicator: no memory of their own."""
    if processes < 2 or not profile.library_reserve_bytes:
        return profile
    share = SHARED_HOST_COPY_EFFICIENCY
    shared = dataclasses.replace(
        profile, h2d_bytes_per_s=profile.h2d_bytes_per_s * share,
        d2h_bytes_per_s=profile.d2h_bytes_per_s * share,
        h2d_duplex_bytes_per_s=profile.h2d_duplex_bytes_per_s * share,
        d2h_duplex_bytes_per_s=profile.d2h_duplex_bytes_per_s * share)
    if transport != "nccl":
        return shared
    if processes == replicas == 2:  # rings of 1: one communicator, the world
        extra = RINGS_OF_ONE_RESERVE_BYTES
    else:
        extra = nccl_reserve_bytes(processes) + (REPLICA_RESERVE_BYTES if replicas > 1 else 0)
    return dataclasses.replace(
        shared, library_reserve_bytes=profile.library_reserve_bytes + extra)


def head_layer_units(cfg: ModelConfig, ch, profile: HardwareProfile,
                     grad_accum: GradAccum = GradAccum.BF16) -> float:
    """The final norm + lm_head's compute per chunk in layers' worth (one layer's forward and
    backward of the same chunk, the mean over a round's chunks), from the cost model: about 2
    for 8b at 8k (vocabulary 128k). The head's sub-chunk is the cost model's default one."""
    costs = chunk_costs(cfg, ch, profile)
    layer_s = sum(c.fwd_s + c.bwd_s for c in costs) / len(costs)
    head_s = head_seconds(cfg, ch.chunk_tokens, head_sub_tokens(ch.chunk_tokens),
                          2 if grad_accum == GradAccum.BF16 else 4, profile)
    return head_s / max(layer_s, 1e-30)


def make_rank_plans(cfg: ModelConfig, seqlen: int, budget: Budget,
                    profile: HardwareProfile | None = None, n_ranks: int = 2, *,
                    grad_accum: GradAccum = GradAccum.BF16, replicas: int = 1,
                    placement: Placement | str = Placement.CYCLIC, split_fetch: bool = False,
                    vocab_parallel: bool = False, **constraints) -> tuple[RankPlan, ...]:
    """One plan per rank under the per-device `budget`. Rank 0 (the most layers and the
    embedding) is planned first; its chunking (chunk_tokens, chunks_per_round, rounds_per_step)
    is then imposed on the others, because every rank must process the same chunks in the same
    rounds. `replicas` R: the plans are those of one ring; each replica trains R-th of the
    global batch (seqs_per_step rows each). `placement` (PLACEMENTS): how the layers are dealt
    (_placed). `split_fetch` (with replicas > 1; ignored with one): RankPlan.split_fetch.
    `vocab_parallel`: every rank holds a shard of the head (RankPlan.vocab_parallel; a ring of
    one rank holds the whole head, as without it).
    Raises InfeasibleBudget (from make_plan) naming the rank's smallest budgets."""
    check_ring(cfg.n_layers, n_ranks, replicas=replicas)
    placement = parse_placement(placement)
    vp = bool(vocab_parallel) and n_ranks > 1  # a ring of 1 holds the whole head anyway
    if vp:
        refuse_vocab_parallel(cfg, n_ranks)
    owners, first = _placed(cfg, seqlen, budget, profile, n_ranks, grad_accum, constraints,
                            placement, vp)
    # Ranks with the same number of layers and the same embedding / head plan alike (a ring of
    # 64 has at most four kinds): plan each kind once and give the others its plan.
    kinds: dict[tuple, RankPlan] = {}
    out = []
    for r in range(n_ranks):
        layers = owned_layers(cfg.n_layers, n_ranks, r, owners)
        model = rank_model(cfg, n_ranks, r, owners, vp)
        key = (len(layers), model.head_rows, r == head_rank(cfg.n_layers, n_ranks, owners),
               *sorted(_holds(cfg, n_ranks, r, owners, vp).items()))
        if r == 0 or key not in kinds:
            rp = _rank_plan(cfg, seqlen, budget, profile, n_ranks, r, first, grad_accum,
                            constraints, replicas, placement, owners, vp)
            kinds.setdefault(key, rp)
        else:
            like = kinds[key]
            rp = dataclasses.replace(
                like, rank=r, layers=layers,
                plan=dataclasses.replace(like.plan, model=model))
        out.append(dataclasses.replace(rp, split_fetch=bool(split_fetch) and replicas > 1))
    return tuple(out)


def make_rank_plan(cfg: ModelConfig, seqlen: int, budget: Budget,
                   profile: HardwareProfile | None, n_ranks: int, rank: int, *,
                   grad_accum: GradAccum = GradAccum.BF16, replicas: int = 1,
                   placement: Placement | str = Placement.CYCLIC, split_fetch: bool = False,
                   vocab_parallel: bool = False, **constraints) -> RankPlan:
    """The plan of one rank alone (what each ring process computes for itself): rank 0's plan
    fixes the chunking, and the placement's owners follow from it, as in make_rank_plans, so
    every rank agrees without talking; a 'round_overlap' depth: overlap_rank_plans' own."""
    depth = constraints.pop("round_overlap", 0)
    if depth:  # every rank plans the whole ring alike and keeps its own plan
        return overlap_rank_plans(cfg, seqlen, budget, profile, n_ranks, depth,
                                  grad_accum=grad_accum, replicas=replicas, placement=placement,
                                  split_fetch=split_fetch, vocab_parallel=vocab_parallel,
                                  **constraints)[rank]
    check_ring(cfg.n_layers, n_ranks, rank, replicas)
    placement = parse_placement(placement)
    vp = bool(vocab_parallel) and n_ranks > 1
    if vp:
        refuse_vocab_parallel(cfg, n_ranks)
    owners, first = _placed(cfg, seqlen, budget, profile, n_ranks, grad_accum, constraints,
                            placement, vp)
    rp = _rank_plan(cfg, seqlen, budget, profile, n_ranks, rank, first, grad_accum, constraints,
                    replicas, placement, owners, vp)
    return dataclasses.replace(rp, split_fetch=bool(split_fetch) and replicas > 1)


def _placed(cfg, seqlen, budget, profile, n_ranks, grad_accum, constraints,
            placement, vp: bool = False) -> tuple[tuple[int, ...], Plan]:
    """(the owners of the placement, empty for cyclic; rank 0's plan). Not cyclic: rank 0 of
    the cyclic ring is planned first for its chunking, the head's cost in layers at that
    chunking (head_layer_units) deals the layers, and rank 0 is planned again with its own
    layers under that chunking (so every rank computes the same owners)."""
    if cfg.tie_embeddings and n_ranks > 1:  # one parameter would live on two ranks
        raise ConfigError(f"{cfg.name} ties its head to the embedding (one parameter), but a ring "
                          f"of {n_ranks} puts the embedding on rank 0 and the head on the last "
                          "layer's rank; train it on one GPU or as data-parallel replicas "
                          "(rings of 1)")
    constraints = _no_segments(constraints, n_ranks)
    first = make_plan(rank_model(cfg, n_ranks, 0, None, vp), seqlen, budget, profile,
                      grad_accum=grad_accum, **constraints, **_holds(cfg, n_ranks, 0, (), vp))
    if placement is Placement.CYCLIC or n_ranks == 1:
        return (), first
    ch = first.chunking
    owners = layer_owners(cfg.n_layers, n_ranks, placement,
                          head_layer_units(cfg, ch, first.profile, grad_accum))
    shared = dict(constraints, chunk_tokens=ch.chunk_tokens, chunks_per_round=ch.chunks_per_round,
                  rounds_per_step=ch.rounds_per_step)
    if cfg.moe is not None:
        moe_routing_chain(cfg.name, cfg.n_layers, n_ranks, owners, placement)
    first = make_plan(rank_model(cfg, n_ranks, 0, owners, vp), seqlen, budget, profile,
                      grad_accum=grad_accum, **shared, **_holds(cfg, n_ranks, 0, owners, vp))
    return owners, first


def _no_segments(constraints: dict, n_ranks: int) -> dict:
    """A ring rank's constraints: no layer-segment recompute (a segment re-runs consecutive
    local layers, which are not consecutive layers of the model), so the search finds the best
    plan without it instead of one the ring would have to refuse."""
    return dict(constraints, segments=False) if n_ranks > 1 else dict(constraints)


def _holds(cfg: ModelConfig, n_ranks: int, r: int, owners: tuple[int, ...] = (),
           vp: bool = False) -> dict:
    """make_plan's holds_embed / holds_head for rank r: it plans and allocates only the
    embedding and head it owns (Plan.holds_embed); with a vocabulary-parallel head every rank
    holds its shard of the head."""
    if n_ranks == 1:
        return {}
    return {"holds_embed": r == embed_rank(cfg.n_layers, n_ranks),
            "holds_head": vp or r == head_rank(cfg.n_layers, n_ranks, owners)}


def _rank_plan(cfg, seqlen, budget, profile, n_ranks, r, first, grad_accum, constraints,
               replicas=1, placement=Placement.CYCLIC, owners=(), vp=False):
    ch = first.chunking
    shared = dict(_no_segments(constraints, n_ranks), chunk_tokens=ch.chunk_tokens,
                  chunks_per_round=ch.chunks_per_round, rounds_per_step=ch.rounds_per_step)
    plan = first if r == 0 else make_plan(rank_model(cfg, n_ranks, r, owners, vp), seqlen,
                                          budget, profile, grad_accum=grad_accum, **shared,
                                          **_holds(cfg, n_ranks, r, owners, vp))
    if n_ranks > 1 and getattr(plan, "segment_layers", 1) > 1:
        # A segment re-runs the forward of consecutive local layers from the first one's input,
        # but a rank's consecutive local layers are not consecutive layers of the model (the
        # layers between live on other ranks), and its residual buffers carry messages.
        raise ConfigError(
            f"rank {r} of a ring of {n_ranks} fits {cfg.name} at seqlen {seqlen:,} only by "
            f"recomputing segments of {plan.segment_layers} layers, which a ring rank cannot "
            f"run; give each rank more host or device memory, or use fewer ranks")
    return RankPlan(rank=r, n_ranks=n_ranks, layers=owned_layers(cfg.n_layers, n_ranks, r, owners),
                    has_embed=r == embed_rank(cfg.n_layers, n_ranks),
                    has_head=r == head_rank(cfg.n_layers, n_ranks, owners),
                    n_layers=cfg.n_layers, plan=plan, replicas=replicas,
                    placement=placement if n_ranks > 1 else Placement.CYCLIC, owners=owners,
                    vocab_parallel=vp)


# -- the scaling model --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    name: str
    bytes_per_s: float
    """Sustained one-way rate of a point-to-point transfer between neighbours (full duplex)."""
    latency_s: float


LINKS = (
    Link(name="nvlink", bytes_per_s=150e9, latency_s=10e-6),
    Link(name="infiniband-400g", bytes_per_s=45e9, latency_s=20e-6),
    Link(name="ethernet-10g", bytes_per_s=1.1e9, latency_s=100e-6),
    Link(name="internet-1g", bytes_per_s=0.1e9, latency_s=30e-3),
)
"""Assumed rates, not measured: NVLink 4 between H100s (~150 GB/s achieved per peer for large
messages), 400 Gb/s NDR InfiniBand per GPU, 10 GbE, and a 1 Gb/s wide-area link with 30 ms
latency (the 'internet-scale' case)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RingPrediction:
    n_ranks: int
    link: str
    chunks_per_round: int
    rank_step_time_s: float
    """The slowest rank's own predicted step (its layers, its copies, its optimizer)."""
    bubble_frac: float
    """Share of each rank's layer work lost to an under-full ring: 1 - min(1, C / N)."""
    fill_s: float
    """What the ring adds to its slowest rank's own step: the round's critical path (fill and
    drain, the head and embedding every rank waits for, the hops) beyond that rank's work."""
    link_s: float
    """Time the slowest rank's sends take per step if nothing hid them."""
    step_time_s: float
    tok_per_s: float
    speedup: float
    """tok_per_s over the single-device plan's prediction under the same per-device budgets
    (NaN when one device does not fit them)."""
    device_bytes: int
    """Per device (the largest rank's plan)."""
    host_bytes: int
    overlap_depth: int = dataclasses.field(default=0, metadata={"omit_if_default": True})
    """Local layers of the next round each rank runs during this round's drain (0: rounds in
    turn; dataflow.memplan.search.ring_overlap)."""


def _owners(rank_plans: tuple[RankPlan, ...]) -> tuple[int, ...]:
    """The rank of every global layer, from the ranks' own layer lists (any placement)."""
    owners = [0] * rank_plans[0].n_layers
    for rp in rank_plans:
        for g in rp.layers:
            owners[g] = rp.rank
    return tuple(owners)


def _visits(owners: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """The walk's visits in forward order: (rank, the global layers it runs there in a row)."""
    out: list[tuple[int, list[int]]] = []
    for g, r in enumerate(owners):
        if out and out[-1][0] == r:
            out[-1][1].append(g)
        else:
            out.append((r, [g]))
    return out


def _chunk_seconds(rp: RankPlan) -> tuple[list[float], list[list[float]], float, float]:
    """(forward seconds of each chunk of a layer, backward seconds of each chunk of each local
    layer (recompute included), the head's seconds a round, the rank's layer and head work a
    round): the cost model's numbers (cost.workload_of, cost.chunk_costs), as simulate_ring
    times them."""
    plan, p = rp.plan, rp.plan.profile
    d, w = decisions_of(plan), workload_of(plan, p)
    costs = chunk_costs(d.model, d.chunking, p, d.attention_bwd is AttentionBwd.DETERMINISTIC,
                        d.precision)
    bwd = []
    for j in range(len(rp.layers)):
        row = [c.bwd_s + c.rec_s[LEVEL_INDEX[a.level]] for c, a in zip(costs, d.activations[j])]
        rest = (w.bwd_s[j] - sum(row)) / len(costs)  # KV rebuilds: spread over the chunks
        bwd.append([x + rest for x in row])
    head_s = w.head_s if rp.holds_head_block else 0.0
    if rp.vocab_parallel:  # a shard forms its logits twice: for the statistics, then the grads
        head_s *= VOCAB_HEAD_GEMMS / 3
    return [c.fwd_s for c in costs], bwd, head_s, len(rp.layers) * w.fwd_s + sum(w.bwd_s) + head_s


VOCAB_HEAD_GEMMS = 4
"""GEMMs of a vocabulary-parallel shard's head per chunk (logits for the statistics, logits
again, dx, dW) against one device's 3 (dataflow.memplan.step.ring_vocab keeps no logits)."""


def vocab_hop_s(rp: RankPlan, link: Link) -> float:
    """A vocabulary-parallel head's four messages of one chunk over one hop of the ring's
    chain: the normed hidden state (T x D bf16), the statistics back and the merged ones round
    (T x 3 fp32 each), the partial dx back (T x D fp32)."""
    t, d = rp.plan.chunking.chunk_tokens, rp.plan.model.model_dim
    nbytes = t * d * 2 + 2 * t * 3 * 4 + t * d * 4
    return nbytes / link.bytes_per_s + 4 * link.latency_s


def vocab_exchange_s(rp: RankPlan, link: Link) -> float:
    """A vocabulary-parallel head's messages on a round's critical path: four passes of the
    round's C chunks along the chain of N - 1 hops, each chunk sent on as soon as it is there
    (dataflow.memplan.step.ring_vocab), a pipeline of N - 2 + C chunk-hops."""
    n, c = rp.n_ranks, rp.plan.chunking.chunks_per_round
    return max(0, n - 2 + c) * vocab_hop_s(rp, link)


def _pipeline_pass(visits, seconds, order: list[int], hop_s: float, free_s: dict,
                   start_s: float) -> dict:
    """One direction of a round through the ring's visits (the forward's walk, or the backward's
    reversed), chunk by chunk: rank -> when it is done with this direction. A rank runs each
    visit's layers layer-major, chunks in `order`, each chunk once it has arrived and the rank
    is done with what came before (free_s); seconds(rank, layer, chunk) is its cost. A visit's
    last layer sends each chunk on its own send stream, one hop (bytes / rate + latency) each,
    to the next visit. O(layers x chunks)."""
    done, sending = dict(free_s), {}
    arrive = {c: start_s for c in order}
    for r, layers in visits:
        t = done.get(r, 0.0)
        ready = arrive
        for g in layers:
            out = {}
            for c in order:
                t = max(t, ready[c]) + seconds(r, g, c)
                out[c] = t
            ready = out
        done[r] = t
        s, arrive = sending.get(r, 0.0), {}
        for c in order:
            s = max(s, ready[c]) + hop_s
            arrive[c] = s
        sending[r] = s
    return done


def ring_round_s(rank_plans: tuple[RankPlan, ...], hop_s: float,
                 vocab_round_s: float = 0.0) -> tuple[float, dict]:
    """(the critical path of one round through the ring, rank -> its own layer and head work a
    round): the forward's walk from rank 0 to the head's rank, the head there, and the
    backward's walk back (_pipeline_pass), at the cost model's seconds of every layer and chunk
    on its rank (_chunk_seconds). The pipeline's fill and drain, an under-full ring's idle
    (C < N), a hop at every layer when C = N leaves no slack, and chunks of unequal cost
    (recompute, a long sequence's later chunks) are all this path's length less a rank's work.
    A vocabulary-parallel head (RankPlan.vocab_parallel) runs on every rank between the walks:
    the slowest shard's head plus vocab_round_s of messages (vocab_exchange_s), every rank busy
    with it until the backward starts."""
    visits = _visits(_owners(rank_plans))
    fwd_c, bwd_c, work, head_s, head = {}, {}, {}, 0.0, rank_plans[-1].rank
    kinds: dict[tuple, tuple] = {}  # ranks planned alike (make_rank_plans) share their costs
    for rp in rank_plans:
        key = (id(rp.plan.activations), len(rp.layers), rp.has_embed, rp.has_head,
               rp.holds_head_block)
        if key not in kinds:
            kinds[key] = _chunk_seconds(rp)
        fwd_c[rp.rank], bwd, h, work[rp.rank] = kinds[key]
        bwd_c.update(zip(rp.layers, bwd))
        if rp.has_head:
            head = rp.rank
        head_s = max(head_s, h)
    order = list(range(rank_plans[0].plan.chunking.chunks_per_round))
    fwd = _pipeline_pass(visits, lambda r, g, c: fwd_c[r][c], order, hop_s, {}, 0.0)
    if rank_plans[0].vocab_parallel:  # every rank takes part; the head's rank starts it
        turn = max(fwd.values()) + head_s + vocab_round_s
        free = {rp.rank: turn for rp in rank_plans}
    else:
        turn = fwd[head] + head_s
        free = {**fwd, head: turn}
    bwd = _pipeline_pass(visits[::-1], lambda r, g, c: bwd_c[g][c], order[::-1], hop_s,
                         free, turn)
    return max(bwd.values()), work


def _sends_per_chunk(owners: tuple[int, ...], rank: int) -> int:
    """Messages `rank` sends per chunk and round: a residual at the end of each of its visits
    but the last layer's, a gradient at the start of each but layer 0's."""
    last = len(owners) - 1
    return sum((g < last and owners[g + 1] != rank) + (g > 0 and owners[g - 1] != rank)
               for g, r in enumerate(owners) if r == rank)


def predict_ring(rank_plans: tuple[RankPlan, ...], link: Link,
                 single_tok_per_s: float | None = None, overlap: bool = False) -> RingPrediction:
    """Ring step time from the ranks' own predictions and the round's critical path. Each round
    takes the critical path of ring_round_s (the forward's walk, the head, the backward's walk,
    each hop a chunk's residual or gradient, T*D*2 bytes, over the link); the step adds the
    largest of the ranks' own extras (a rank's predicted step less its layer and head work:
    exposed copies, the optimizer). It is bounded below by the busiest rank's sends, and scaled
    by the measured ring_efficiency for N >= 2 (lower with more chunks a round than ranks). A model, not a measurement: docs/ring.md
    compares it with simulate_ring (every rank's compiled schedule timed together). `overlap`:
    the next round's first layers run during this round's drain, as deep as every rank's
    device budget allows (ring_overlap.ring_depth; its rounds by ring_overlap's model)."""
    n = len(rank_plans)
    slow = max(rank_plans, key=lambda rp: rp.plan.prediction.step_time_s)
    p0 = rank_plans[0].plan
    ch, cfg = p0.chunking, p0.model
    rounds, chunks = ch.rounds_per_step, ch.chunks_per_round
    hop_s = ch.chunk_tokens * cfg.model_dim * 2 / link.bytes_per_s + link.latency_s
    bubble = 1.0 - min(1.0, chunks / n) if n > 1 else 0.0
    rank_s = slow.plan.prediction.step_time_s
    step_s, fill_s, link_s, depth = rank_s, 0.0, 0.0, 0
    if n > 1:
        vp = rank_plans[0].vocab_parallel
        vocab_s = vocab_exchange_s(rank_plans[0], link) if vp else 0.0
        round_s, work = ring_round_s(rank_plans, hop_s, vocab_s)
        depth = ring_depth(rank_plans) if overlap else 0
        rounds_s = rounds * round_s
        if depth:  # an ordering that loses to rounds in turn is not run
            over_s = overlapped_rounds_s(rank_plans, hop_s, depth, vocab_s)
            rounds_s, depth = (over_s, depth) if over_s < rounds_s else (rounds_s, 0)
        extra_s = max(max(0.0, rp.plan.prediction.step_time_s - rounds * work[rp.rank])
                      for rp in rank_plans)
        owners = _owners(rank_plans)
        link_s = max(_sends_per_chunk(owners, rp.rank) for rp in rank_plans) * chunks * \
            rounds * hop_s + (chunks * rounds * vocab_hop_s(rank_plans[0], link) if vp else 0.0)
        step_s = max(rounds_s + extra_s, link_s, rank_s)
        fill_s = step_s - rank_s
        step_s /= ring_efficiency(n, chunks)
    tok_s = ch.tokens_per_step / step_s
    return RingPrediction(
        n_ranks=n, link=link.name, chunks_per_round=chunks, rank_step_time_s=rank_s,
        bubble_frac=bubble, fill_s=fill_s, link_s=link_s, step_time_s=step_s, tok_per_s=tok_s,
        speedup=tok_s / single_tok_per_s if single_tok_per_s else math.nan,
        device_bytes=max(rp.plan.memory.device_bytes for rp in rank_plans),
        host_bytes=max(rp.plan.memory.host_bytes for rp in rank_plans), overlap_depth=depth)


def rank_plan_options(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile,
                      n_ranks: int, **constraints) -> list[tuple[RankPlan, ...]]:
    """The ring planned with the planner's chunking and, when that has fewer chunks per round
    than ranks (an under-full ring), again with a multiple of N chunks per round if it fits.
    `constraints` go to every rank's make_plan (a global batch as tokens_per_step, say)."""
    options = [make_rank_plans(cfg, seqlen, budget, profile, n_ranks, **constraints)]
    c = options[0][0].plan.chunking.chunks_per_round
    if c < n_ranks:
        try:
            options.append(make_rank_plans(cfg, seqlen, budget, profile, n_ranks,
                                           **dict(constraints,
                                                  chunks_per_round=math.lcm(c, n_ranks))))
        except (ConfigError, InfeasibleBudget, ValueError):  # more chunks may not fit
            pass
    return options


def best_rank_plans(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile,
                    n_ranks: int, link: Link = LINKS[0]) -> tuple[RankPlan, ...]:
    """Of rank_plan_options, the one with the higher predicted tok/s over `link` (not the
    shorter step: the options' global batches differ)."""
    return max(rank_plan_options(cfg, seqlen, budget, profile, n_ranks),
               key=lambda rps: predict_ring(rps, link).tok_per_s)


def scaling(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile,
            ranks: tuple[int, ...] = (2, 4, 8, 16, 32, 64),
            links: tuple[Link, ...] = LINKS, transport: str = "nccl", precision: str = "bf16",
            ) -> tuple[tuple[RingPrediction, ...], float | None, str]:
    """(predictions for every N in `ranks` that the model's layer count allows and every link,
    the single-device tok/s or None when one device does not fit the budgets, a note on the ring
    sizes left out). For each N the ring is planned twice, with the planner's chunking and with
    at least N chunks per round (a full ring), and the faster prediction is kept; the ranks
    plan with `transport`'s device memory reserved (ring_profile); every plan, the single
    device's too, in `precision`."""
    refused = []
    try:
        single = make_plan(cfg, seqlen, budget, profile, precision=precision).prediction.tok_per_s
    except InfeasibleBudget as exc:  # a ring may fit where one device does not (issue 18's 32b)
        single = None
        refused.append(f"one device does not fit these budgets ({str(exc).split(';')[0][:160]})")
    out, skipped = [], [n for n in ranks if n > cfg.n_layers]
    for n in (n for n in ranks if n <= cfg.n_layers):
        try:
            options = rank_plan_options(cfg, seqlen, budget, ring_profile(profile, n, transport),
                                        n, precision=precision)
        except ConfigError as exc:  # InfeasibleBudget included: say so, go on with other N
            refused.append(f"N = {n} refused by the planner ({str(exc).split(';')[0][:120]})")
            continue
        for link in links:
            preds = [predict_ring(rp, link, single) for rp in options]
            out.append(max(preds, key=lambda p: p.tok_per_s))  # options differ in batch
    notes = refused + ([] if not skipped else [
        f"N = {', '.join(map(str, skipped))} left out: {cfg.name} has {cfg.n_layers} layers and "
        "a ring holds at least one layer per rank"])
    return tuple(out), single, "\n  ".join(notes)


def speedup_text(x: float) -> str:
    """A ring prediction's speedup for a table: "1.96x", or "n/a" when one device does not fit."""
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def scaling_text(preds: tuple[RingPrediction, ...], single_tok_per_s: float, note: str) -> str:
    """The scaling model as a table: one line per (N, link)."""
    alone = "does not fit" if single_tok_per_s is None else f"{single_tok_per_s:,.0f} tok/s"
    lines = [f"ring scaling (model, per-device budgets; single device {alone}):",
             f"  {'N':>3} {'link':<16} {'C':>3} {'bubble':>7} {'fill s':>8} {'link s':>8} "
             f"{'step s':>9} {'tok/s':>12} {'speedup':>8} {'dev GiB':>8} {'host GiB':>9}"]
    for p in preds:
        lines.append(f"  {p.n_ranks:>3} {p.link:<16} {p.chunks_per_round:>3} "
                     f"{p.bubble_frac:>6.0%} {p.fill_s:>8.3f} {p.link_s:>8.3f} "
                     f"{p.step_time_s:>9.3f} {p.tok_per_s:>12,.0f} {speedup_text(p.speedup):>8s} "
                     f"{p.device_bytes / 2**30:>8.2f} {p.host_bytes / 2**30:>9.2f}")
    if note:
        lines.append("  " + note)
    return "\n".join(lines)
