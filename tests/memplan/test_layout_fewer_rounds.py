"""Replicas of one device of a capped global batch are weighed with fewer, fuller rounds and
fewer resident layers too (layout_chunkings.fewer_rounds_shapes, fewer_resident_shapes), and the
compiled figures choose: 8b at 80 / 24 as 64 split replicas of 16,384 tokens runs one round of
two chunks, not the planner's two of one, with no resident layer, not the planner's 8."""

from __future__ import annotations

from types import SimpleNamespace

from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.layout import choose_layout
from dataflow.memplan.plan.plan import Where
from dataflow.memplan.search.layout_chunkings import (FEWER_ROUNDS_FROM, fewer_resident_shapes,
                                                      fewer_rounds_shapes)
from dataflow.models.config import load_config


def test_fewer_rounds_shapes_divide_the_rounds_of_a_capped_batch():
    def ch(c, r):
        return SimpleNamespace(chunks_per_round=c, rounds_per_step=r)

    capped = {"tokens_per_step": 65536}
    assert fewer_rounds_shapes(ch(1, 2), capped) == [{"chunks_per_round": 2}]
    assert fewer_rounds_shapes(ch(2, 4), capped) == [{"chunks_per_round": 4},
                                                     {"chunks_per_round": 8}]
    assert fewer_rounds_shapes(ch(1, 3), capped) == [{"chunks_per_round": 3}]
    assert fewer_rounds_shapes(ch(1, 1), capped) == []
    assert fewer_rounds_shapes(ch(1, FEWER_ROUNDS_FROM + 2), capped) == []  # the estimate holds
    assert fewer_rounds_shapes(ch(1, 2), {}) == []  # an uncapped batch: the planner's rounds
    assert fewer_rounds_shapes(ch(1, 2), {**capped, "chunks_per_round": 1}) == []  # asked for


def test_fewer_resident_shapes_halve_and_drop_the_residents_of_few_rounds():
    def ch(r):
        return SimpleNamespace(chunks_per_round=2, rounds_per_step=r)

    capped = {"tokens_per_step": 16384}
    assert fewer_resident_shapes(ch(1), 8, capped) == [{"max_resident_layers": 0},
                                                       {"max_resident_layers": 4}]
    assert fewer_resident_shapes(ch(FEWER_ROUNDS_FROM), 1, capped) == [{"max_resident_layers": 0}]
    assert fewer_resident_shapes(ch(1), 0, capped) == []  # nothing resident to give up
    assert fewer_resident_shapes(ch(FEWER_ROUNDS_FROM + 1), 8, capped) == []  # the estimate holds
    assert fewer_resident_shapes(ch(1), 8, {}) == []  # an uncapped batch
    assert fewer_resident_shapes(ch(1), 8, {**capped, "max_resident_layers": 8}) == []  # asked


def test_64_split_replicas_of_8b_take_one_round_of_two_chunks_none_resident():
    c = choose_layout(load_config("8b"), 8192, Budget.from_gib(80, 24), get_profile("h100"), 64,
                      tokens_per_step=1_048_576, ring_size=1, split_update=True, quick=True)
    ch = c.rank_plans[0].plan.chunking
    assert (ch.chunks_per_round, ch.rounds_per_step) == (2, 1)
    plan = c.rank_plans[0].plan
    assert not any(lp.weights is Where.DEVICE for lp in plan.layers)
    assert dict(c.chosen.constraints)["max_resident_layers"] == 0
    # 50.96 with the planner's 2 rounds of one, 53.61 with one round of two and 8 resident layers
    assert c.chosen.on("nvlink").speedup > 55.0
