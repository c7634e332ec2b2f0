"""The multi-GPU layouts' figures come from compiled schedules (memplan.search.layout
choose_layout, RESCORED): the search's per-round estimate ranks each layout's candidates, then
the best few are predicted again from their ranks' compiled schedules (predict_schedule, as one
device's final prediction and budget_truth's are), and so is the one device they are compared
with. Why: the per-round estimate charges the deferred update whole, so it is slow at a few
rounds a step, which is where the replicas of a capped global batch train."""

from __future__ import annotations

import dataclasses

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.cost import predict
from dataflow.memplan.search.layout import allreduce_seconds, choose_layout
from dataflow.memplan.search.predict import predict_schedule, reduce_exposure_seconds
from dataflow.memplan.search.ring_plan import LINKS
from dataflow.models.config import load_config

H100 = get_profile("h100")
B8 = Budget.from_gib(80, 24)


def test_the_search_estimate_is_slow_at_a_few_rounds_a_step():
    """8b at 80 / 24: at 4 rounds a step the compiled schedule predicts > 1 % more tok/s than
    the search's estimate (the update partly hidden in the next step's first round: 1.7 % since
    the simulated host link carries each direction once, bench/records/s40/; 3-4 % before); at
    64, < 1 %.
    (8k chunks in 4 rounds fixed: at 65,536 tokens make_plan's own compiled figures prefer
    other shapes, search.RESCORED_CHUNKINGS.)"""
    cfg = load_config("8b")
    few = make_plan(cfg, 8192, B8, H100, tokens_per_step=65_536, chunk_tokens=8192,
                    rounds_per_step=4)
    many = make_plan(cfg, 8192, B8, H100, tokens_per_step=1_048_576)
    assert few.chunking.rounds_per_step == 4 and many.chunking.rounds_per_step == 64
    ratio = [predict_schedule(p, H100).tok_per_s / predict(p, H100).tok_per_s
             for p in (few, many)]
    assert ratio[0] > 1.01 and abs(ratio[1] - 1) < 0.01, ratio


def test_a_replica_layout_and_its_single_device_are_predicted_compiled():
    """2 replicas of a ring of 1 at a 1M-token batch: the option's step is its rank plan's
    compiled step plus the time its all-reduces add timed in that step (what copy waits hide
    is not charged: at most the wire time), and the speedup's one device is its compiled plan."""
    cfg = load_config("8b")
    c = choose_layout(cfg, 8192, B8, H100, 2, tokens_per_step=1_048_576, ring_size=1,
                      quick=True)
    (rp,) = c.rank_plans
    p = c.chosen.on("nvlink")
    exposed = reduce_exposure_seconds(dataclasses.replace(rp, replicas=2), LINKS[0].bytes_per_s,
                                      LINKS[0].latency_s)
    assert 0 < exposed <= allreduce_seconds(rp, 2, LINKS[0]) * (1 + 1e-9)
    want = predict_schedule(rp.plan, rp.plan.profile).step_time_s + exposed
    assert abs(p.step_time_s - want) <= 1e-9 * want
    one = predict_schedule(make_plan(cfg, 8192, B8, H100), H100).tok_per_s
    assert c.single_tok_per_s == one and abs(p.speedup - p.tok_per_s / one) < 1e-12
