"""Split weight fetches (RankPlan.split_fetch) as the planner sees them: the layout predicts them
only when asked and only where replicas stream weights; the compiled schedules of the replicas
differ only in which part each fetches, and every gather follows its part's copy and precedes
the use's compute. (Bit-level training checks: tests/ring/test_ring_cpu.py, test_ring_moe.py.)
Beside them, the NCCL transport's communicators, which the gathers share."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.search.layout import choose_layout
from dataflow.memplan.search.ring_plan import make_rank_plans
from dataflow.memplan.step.ring_compile import GATHER, GatherParts, compile_ring_schedule
from dataflow.memplan.step.compile import COMPUTE, H2D, Fetch, Record, Wait
from tests.ring.small_rings import BUDGET, CPU, tiny_with

STREAMED = {"max_resident_layers": 0}


def test_layout_splits_fetches_only_when_asked_and_weights_stream():
    cfg = tiny_with(2)
    plain = choose_layout(cfg, 64, BUDGET, CPU, 2, ring_size=1, constraints=STREAMED,
                          single_tok_per_s=None)
    split = choose_layout(cfg, 64, BUDGET, CPU, 2, ring_size=1, constraints=STREAMED,
                          single_tok_per_s=None, split_fetch=True)
    assert not plain.chosen.layout.split_fetch and split.chosen.layout.split_fetch
    for a, b in zip(plain.chosen.predictions, split.chosen.predictions):
        assert 0.5 < b.tok_per_s / a.tok_per_s < 2.0, (a, b)
    resident = choose_layout(cfg, 64, BUDGET, CPU, 2, ring_size=1, single_tok_per_s=None,
                             split_fetch=True)
    assert all(lp.weights.value == "device" for rp in resident.rank_plans
               for lp in rp.plan.layers)
    assert not resident.chosen.layout.split_fetch  # nothing streams: nothing to split


def test_replicas_fetch_their_own_parts_and_gather_before_compute():
    rp = make_rank_plans(tiny_with(2), 64, BUDGET, CPU, 1, replicas=2, split_fetch=True,
                         **STREAMED)[0]
    scheds = [compile_ring_schedule(rp, replica=q).events for q in range(2)]
    kinds = [[type(e).__name__ for e in events] for events in scheds]
    assert kinds[0] == kinds[1]  # the same events, in the same order, on both replicas
    for q, events in enumerate(scheds):
        gathers = [i for i, e in enumerate(events) if type(e) is GatherParts]
        assert gathers
        for i in gathers:
            g = events[i]
            # just before: the part's Fetch, its H2D record, the gather stream waiting for it
            fetch, rec, wait = events[i - 3], events[i - 2], events[i - 1]
            assert type(fetch) is Fetch and fetch.dst.region == g.dst.region
            n = g.dst.nbytes // 2
            assert (fetch.dst.offset, fetch.dst.nbytes) == (g.dst.offset + q * n, n)
            assert fetch.src.offset % n == 0 and fetch.src.offset // n == q
            assert rec == Record(H2D, rec.id) and wait == Wait(GATHER, rec.id)
            done = events[i + 1]
            assert type(done) is Record and done.stream == GATHER
            later = [e for e in events[i + 2:] if type(e) is Wait and e.id == done.id]
            assert later and later[0].stream == COMPUTE  # the use's compute waits for it
    unsplit = compile_ring_schedule(dataclasses.replace(rp, split_fetch=False)).events
    assert not any(type(e) is GatherParts for e in unsplit)


def test_nccl_communicators_every_process_makes_in_one_order():
    """The NCCL transport's communicators (made in this order on every process): the world, a
    ring's directed pairs, one per ring rank across the replicas -- none for rings of 1, whose
    world has the replicas' members and serves as their communicator (all-reduce, part gathers
    and the control plane then share its stream)."""
    from dataflow.ring.nccl import communicators

    assert communicators(1, 2) == [("world", (0, 1))]
    assert communicators(1, 4) == [("world", (0, 1, 2, 3))]
    assert communicators(2, 1) == [("world", (0, 1)), ("pair", (0, 1)), ("pair", (1, 0))]
    assert communicators(2, 2) == [
        ("world", (0, 1, 2, 3)), ("pair", (0, 1)), ("pair", (1, 0)), ("pair", (2, 3)),
        ("pair", (3, 2)), ("replicas", (0, 2)), ("replicas", (1, 3))]
