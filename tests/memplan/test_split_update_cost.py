"""The cost model charges a split-update replica's AdamW for its part (Plan.state_parts R: the
largest of the R parts of every layer and of the head, the embedding whole), in the search's
States and in a plan's estimate alike; Decisions.whole_update_cost scores it as if whole (the
search's older scoring, which choose_layout weighs beside it); and a parted plan's replica
prediction is scaled from its whole estimate, so the part is not counted twice."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import Budget, OptimizerWhere
from dataflow.memplan.plan.split import part_numel_max, split_memory_map
from dataflow.memplan.search.cost import predict, workload_of
from dataflow.memplan.search.predict import replica_prediction
from dataflow.memplan.search.layout import _option, choose_layout
from dataflow.memplan.search.ring_plan import LINKS, make_rank_plans, ring_profile
from dataflow.models.config import load_config

H100 = get_profile("h100")
CFG = load_config("1b")
BUDGET = Budget.from_gib(40, 10)
"""1b at 8k on one H100 with 10 GiB of device memory: most layers streamed with their AdamW."""
SEQS = 16 * 8192


@pytest.fixture(scope="module")
def whole():
    return make_plan(CFG, 8192, BUDGET, H100, tokens_per_step=SEQS)


def _opt_elems(w) -> dict:
    return {OptimizerWhere.DEVICE: w.opt_device_elems, OptimizerWhere.STREAMED:
            w.opt_streamed_elems, OptimizerWhere.HOST: w.opt_host_elems}


@pytest.mark.parametrize("parts", [2, 8])
def test_a_parted_plans_estimate_charges_adamw_for_its_part(whole, parts):
    """The same decisions with state_parts R: every layer and the head count the largest of
    their R parts in the optimizer's elements, the embedding its whole; the AdamW estimate
    falls; scored whole (whole_update_cost) the estimate is the unsplit plan's exactly."""
    d = decisions_of(whole)
    elems = buffers.block_elems(CFG)
    want = {k: 0 for k in OptimizerWhere}
    for lp in d.layers:
        want[lp.optimizer] += part_numel_max(elems["layer"], parts)
    want[d.head.optimizer] += part_numel_max(elems["head"], parts)
    want[d.embed.optimizer] += elems["embed"]
    parted = dataclasses.replace(d, state_parts=parts)
    assert _opt_elems(workload_of(parted, H100)) == want
    assert predict(parted, H100).optimizer_s < whole.prediction.optimizer_s
    assert predict(dataclasses.replace(parted, whole_update_cost=True), H100) == \
        whole.prediction


def test_the_search_scores_a_parted_replica_by_its_part(whole):
    """make_plan(state_parts=8) predicts its own AdamW for the part (its plan's estimate is the
    cost model's of its decisions); with whole_update_cost its AdamW is the whole one's."""
    parted = make_plan(CFG, 8192, BUDGET, H100, tokens_per_step=SEQS, state_parts=8)
    scored_whole = make_plan(CFG, 8192, BUDGET, H100, tokens_per_step=SEQS, state_parts=8,
                             whole_update_cost=True)
    assert parted.state_parts == scored_whole.state_parts == 8
    assert parted.prediction == predict(parted, H100)
    d = dataclasses.replace(decisions_of(scored_whole), whole_update_cost=True)
    assert scored_whole.prediction == predict(d, H100)
    assert parted.prediction.optimizer_s < scored_whole.prediction.optimizer_s


def test_a_parted_plans_replica_prediction_counts_the_part_once(whole):
    """A plan parted from the start with a whole plan's decisions is predicted as that whole
    plan run split (its part's AdamW charged by the compiled split schedule's ratio alone)."""
    rp = make_rank_plans(CFG, 8192, BUDGET, H100, 1, replicas=4, tokens_per_step=4 * 8192)[0]
    plan = dataclasses.replace(rp.plan, state_parts=4, memory=split_memory_map(rp.plan, 4))
    plan = dataclasses.replace(plan, prediction=predict(plan, H100))
    assert plan.prediction.step_time_s < rp.plan.prediction.step_time_s
    split = dataclasses.replace(rp, split_update=True)
    got = replica_prediction(dataclasses.replace(split, plan=plan), 150e9, 10e-6)
    want = replica_prediction(split, 150e9, 10e-6)
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)


def test_choose_layout_keeps_the_faster_of_the_part_and_the_whole_scoring():
    """8 split replicas of 1b at 40 / 10: the chosen layout predicts at least the tok/s of the
    replicas planned parted with either scoring (the part's AdamW, or the whole's)."""
    prof = ring_profile(H100, 8, "nccl", 8)
    c = choose_layout(CFG, 8192, BUDGET, H100, 8, tokens_per_step=8 * SEQS, ring_size=1,
                      quick=True, split_update=True)
    got = c.chosen.on(c.link).tok_per_s
    for extra in ({}, {"whole_update_cost": True}):
        asked = {"tokens_per_step": SEQS, "state_parts": 8, **extra}
        rps = make_rank_plans(CFG, 8192, BUDGET, prof, 1, replicas=8, **asked)
        alone = _option(rps, 8, 8, LINKS, None, asked, split_update=True)
        assert got >= alone.on(c.link).tok_per_s * (1 - 1e-12), extra
