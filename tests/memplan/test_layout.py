"""Planning for a number of GPUs (memplan.layout): the split into replicas of a ring that predicts
the most tok/s, its alternatives, the global batch cap, the replicas' all-reduce, and the
issue's on-paper targets for 8b at 8k on 80/24 per H100."""

from __future__ import annotations

import pytest

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.search.layout import allreduce_seconds, choose_layout, layout_text, ring_sizes
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.ring_plan import (LINKS, NCCL_RESERVE_4_BYTES, NCCL_RESERVE_BYTES,
                                        REPLICA_RESERVE_BYTES, make_rank_plans, ring_profile)
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

H100 = get_profile("h100")
B8 = Budget.from_gib(80, 24)


def test_ring_sizes_split_the_gpus_into_whole_replicas_with_a_layer_per_rank():
    assert ring_sizes(8, 32) == [1, 2, 4, 8]
    assert ring_sizes(6, 4) == [1, 2, 3]
    assert ring_sizes(64, 32) == [1, 2, 4, 8, 16, 32]


RINGS_8B: dict = {}
"""The rings these tests plan for 8b at B8 (choose_layout's memo, as one dataflow-plan report
shares it): the choices for 8..64 GPUs plan the same rings of 4, 8, ... with replicas."""


@pytest.mark.parametrize("gpus,at_least", [(2, 1.9), (4, 3.7), (8, 7.2), (16, 14), (32, 27),
                                           (64, 52)])
def test_the_chosen_layout_meets_the_issue_on_paper(gpus, at_least):
    """dataflow-plan 80 24 8192 8b --gpus N --gpu h100 over NVLink: speedup against one device at
    the same budgets and the share of the step each rank waits."""
    c = choose_layout(load_config("8b"), 8192, B8, H100, gpus, memo=RINGS_8B)
    p = c.chosen.on("nvlink")
    assert p.speedup >= at_least, layout_text(c)
    assert p.bubble_frac <= 0.05, layout_text(c)
    assert c.chosen.layout.ring_size * c.chosen.layout.replicas == gpus
    assert c.options[0] is c.chosen
    assert all(o.on("nvlink").tok_per_s <= p.tok_per_s for o in c.options)


def test_a_global_batch_cap_bounds_every_option_and_can_change_the_choice():
    cfg = load_config("8b")
    free = choose_layout(cfg, 8192, B8, H100, 8, memo=RINGS_8B)
    cap = 1_048_576
    capped = choose_layout(cfg, 8192, B8, H100, 8, tokens_per_step=cap, memo=RINGS_8B)
    assert free.chosen.layout.tokens_per_step > cap
    assert all(o.layout.tokens_per_step <= cap for o in capped.options)
    assert capped.chosen.on("nvlink").tok_per_s <= free.chosen.on("nvlink").tok_per_s
    with pytest.raises(ConfigError, match="at least one sequence"):
        choose_layout(cfg, 8192, B8, H100, 8, tokens_per_step=4096)


def test_a_fixed_ring_size_weighs_only_that_split_and_a_bad_one_is_named():
    cfg = load_config("8b")
    c = choose_layout(cfg, 8192, B8, H100, 4, ring_size=2)
    assert {(o.layout.ring_size, o.layout.replicas) for o in c.options} == {(2, 2)}
    with pytest.raises(ConfigError, match="ring sizes that work: 1, 2, 4"):
        choose_layout(cfg, 8192, B8, H100, 4, ring_size=3)


def test_the_allreduce_costs_nothing_alone_and_its_wire_share_grows_with_replicas():
    cfg = load_config("8b")
    (rp,) = make_rank_plans(cfg, 8192, B8, H100, 1)
    link = LINKS[0]
    assert allreduce_seconds(rp, 1, link) == 0.0
    two, eight = allreduce_seconds(rp, 2, link), allreduce_seconds(rp, 8, link)
    assert 0 < two < eight < 2 * two  # 2 (R - 1) / R of the bytes: 1 at R = 2, 1.75 at R = 8


def test_ring_processes_reserve_what_nccl_was_measured_to_hold():
    """The 0.75 GiB a ring of 4 ran over its device budget (433e71d, b008438): four processes
    reserve 1.75 GiB for NCCL, two 1 GiB, replicas another 128 MiB for the all-reduce staging;
    a rank's plan then fits the budget with that reserve counted."""
    base = H100.library_reserve_bytes
    assert ring_profile(H100, 2, "nccl").library_reserve_bytes == base + NCCL_RESERVE_BYTES
    assert ring_profile(H100, 4, "nccl").library_reserve_bytes == base + NCCL_RESERVE_4_BYTES
    assert ring_profile(H100, 4, "nccl", replicas=2).library_reserve_bytes == \
        base + NCCL_RESERVE_4_BYTES + REPLICA_RESERVE_BYTES
    budget = Budget.from_gib(30, 24)
    for rp in make_rank_plans(load_config("8b"), 8192, budget, ring_profile(H100, 4, "nccl"), 4):
        mem = rp.plan.memory
        assert mem.device_bytes + base + NCCL_RESERVE_4_BYTES <= budget.device_bytes + 2**20


def test_processes_sharing_a_host_plan_with_its_shared_copy_rate():
    """Two GPUs of one host streaming at once each got 0.87-0.92 of their copy rate alone
    (s18: 2 replicas of 8b at 60/24 ran 17.2 s a step against one GPU's 15.5 s, all of it
    exposed copy): every rank of a launch of several processes plans at the shared rate, over
    NCCL or shared memory; one process, and the NumPy backend's profile, keep their own."""
    from dataflow.memplan.search.ring_plan import SHARED_HOST_COPY_EFFICIENCY as share

    assert ring_profile(H100, 1, "nccl") == H100
    for transport in ("nccl", "shm"):
        p = ring_profile(H100, 2, transport)
        for rate in ("h2d_bytes_per_s", "d2h_bytes_per_s", "h2d_duplex_bytes_per_s",
                     "d2h_duplex_bytes_per_s"):
            assert getattr(p, rate) == pytest.approx(getattr(H100, rate) * share)
        assert p.peak_bf16_flop_per_s == H100.peak_bf16_flop_per_s
    cpu = get_profile("cpu")
    assert not cpu.library_reserve_bytes  # the NumPy backend's "device" is host memory
    assert ring_profile(cpu, 2, "shm") == cpu


def test_ring_ranks_are_planned_without_segment_recompute():
    """A segment re-runs consecutive local layers, which on a ring rank are not consecutive in
    the model: the search plans ring ranks without segments (the best plan that fits without
    them, or a refusal naming the budgets), where it used to hand the ring a plan it could not
    run (8b at 30/24 per device with 2 chunks a round: segments of 2 layers)."""
    from dataflow.memplan.plan.errors import InfeasibleBudget
    from dataflow.memplan.plan.ranks import rank_model

    cfg, budget = load_config("8b"), Budget.from_gib(30, 24)
    prof = ring_profile(get_profile("h200"), 2, "nccl")
    alone = make_plan(rank_model(cfg, 2, 0), 8192, budget, prof, chunks_per_round=2,
                      rounds_per_step=8, holds_head=False)
    assert alone.segment_layers > 1  # what a single device of that model would run
    with pytest.raises(InfeasibleBudget):
        make_rank_plans(cfg, 8192, budget, prof, 2, chunks_per_round=2, rounds_per_step=8)
    for rp in make_rank_plans(cfg, 8192, budget, prof, 2, rounds_per_step=8):
        assert rp.plan.segment_layers == 1


def test_a_full_ring_is_also_weighed_in_smaller_chunks_and_longer_rounds():
    """Beside the planner's chunking a ring of n weighs n and 2n chunks a round at the planner's
    chunk size and at half and a quarter of it (never below MIN_RING_CHUNK_TOKENS, never a
    shape the caller fixed): 32b at 120/40 on 2 GPUs holds one 8k chunk a round but two of 4k."""
    from dataflow.memplan.search.layout_chunkings import MIN_RING_CHUNK_TOKENS, full_ring_chunkings
    from dataflow.memplan.plan.plan import Chunking

    one = Chunking(seqlen=8192, chunk_tokens=8192, seqs_per_chunk=1, chunks_per_seq=1,
                   chunks_per_round=1, rounds_per_step=72)
    shapes = full_ring_chunkings(one, 2, {})
    assert {"chunks_per_round": 2} in shapes and {"chunks_per_round": 4} in shapes
    assert {"chunk_tokens": 4096, "chunks_per_round": 2} in shapes
    assert {"chunk_tokens": 2048, "chunks_per_round": 4} in shapes
    assert all(s.get("chunk_tokens", 8192) >= MIN_RING_CHUNK_TOKENS for s in shapes)
    # chunks of a split sequence come whole: 2k chunks of an 8k sequence, 4 (or 8) a round
    assert all(s["chunks_per_round"] % (8192 // s.get("chunk_tokens", 8192)) == 0 for s in shapes)
    assert full_ring_chunkings(one, 2, {"chunk_tokens": 8192}) == [{"chunks_per_round": 2},
                                                                   {"chunks_per_round": 4}]
    assert full_ring_chunkings(one, 2, {"chunks_per_round": 1}) == []  # fixed and under-full
    assert full_ring_chunkings(one, 2, {}, few=True) == [{"chunks_per_round": 2}]


def test_rings_with_more_chunks_than_ranks_are_predicted_at_their_measured_efficiency():
    """Rings given 2N chunks a round ran 0.805-0.838 of the model on 4 H100s where a ring of N
    chunks ran 0.894: their step is divided by OVERFULL_RING_EFFICIENCY too, so the layout takes
    more chunks only where they buy more than that (8b at 30/24 on a ring of 4: 4 chunks a
    round, not 8)."""
    from dataflow.memplan.search.ring_plan import (OVERFULL_RING_EFFICIENCY, RING_EFFICIENCY,
                                            ring_efficiency)

    assert ring_efficiency(1, 4) == 1.0
    assert ring_efficiency(4, 4) == RING_EFFICIENCY
    assert ring_efficiency(2, 4) == pytest.approx(RING_EFFICIENCY * OVERFULL_RING_EFFICIENCY)
    choice = choose_layout(load_config("8b"), 8192, Budget.from_gib(30, 24), get_profile("h100"),
                           4, ring_size=4, placements=("cyclic",))
    assert choice.chosen.chunks_per_round == 4
