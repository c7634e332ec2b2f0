"""A capped global batch of a few rounds a step on one device is chosen by the compiled schedules
of its best chunkings, each also planned with fewer resident layers (search.RESCORED_CHUNKINGS):
the search's per-round estimate misranks such plans. A ring rank keeps the estimate's pick (its
ring's schedule, not its own, predicts it)."""

from __future__ import annotations

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.search.search import batch_chunkings
from dataflow.models.config import load_config

H100 = get_profile("h100")
B8 = Budget.from_gib(80, 24)
TOKENS = 16_384


def _estimates_pick(cfg, **constraints):
    """What make_plan chose before: the best plan of each chunking by the search's estimate (the
    resident cap fixed at every layer, which is no cap, so nothing is rescored)."""
    plans = [make_plan(cfg, 8192, B8, H100, tokens_per_step=TOKENS, chunk_tokens=t,
                       chunks_per_round=c, rounds_per_step=r, max_resident_layers=cfg.n_layers,
                       **constraints)
             for t, c, r in batch_chunkings(cfg, 8192, TOKENS // 8192, {})]
    return max(plans, key=lambda p: p.prediction.tok_per_s)


def _compiled(plan) -> float:
    return predict_schedule(plan, plan.profile).tok_per_s


def test_one_device_at_two_sequences_a_step_takes_the_compiled_best():
    """8b at 8k, 80 / 24, 16,384 tokens a step: the estimate's pick (2 rounds of one chunk, 4
    resident layers) is 5,486 tok/s compiled (measured 5,545 on an H100, bench/records/s40/);
    make_plan's (one round of two chunks, 6 resident) is more than 4 % faster within the same
    budgets.
    (5,932 and 6,627 before the host link carried each direction once: the 1-round plan of
    3 resident layers chosen then measured 5,592.)"""
    cfg = load_config("8b")
    old, new = _estimates_pick(cfg), make_plan(cfg, 8192, B8, H100, tokens_per_step=TOKENS)
    assert (old.chunking.rounds_per_step, old.resident_layers) == (2, 4)
    assert abs(_compiled(old) - 5486) < 5, _compiled(old)
    assert _compiled(new) > 1.04 * _compiled(old), (_compiled(new), _compiled(old))
    assert (new.chunking.rounds_per_step, new.resident_layers) != (2, 4)
    assert new.chunking.tokens_per_step == TOKENS
    assert new.memory.device_bytes + H100.library_reserve_bytes <= B8.device_bytes
    assert new.memory.host_bytes <= B8.host_bytes


def test_a_ring_rank_keeps_the_estimates_pick():
    """A rank without the head (of a ring of two or more): no compiled rescoring."""
    cfg = load_config("8b")
    new = make_plan(cfg, 8192, B8, H100, tokens_per_step=TOKENS, holds_head=False)
    assert new == _estimates_pick(cfg, holds_head=False)


def test_a_cap_the_host_budget_cannot_hold_is_passed_over():
    """8b at 8k in 40 / 40: with no resident layer its state needs more host memory than 40 GiB
    (weights, grads and AdamW state all at home), so that cap does not fit; make_plan still
    returns a plan within both budgets."""
    cfg, budget = load_config("8b"), Budget.from_gib(40, 40)
    plan = make_plan(cfg, 8192, budget, H100, tokens_per_step=TOKENS)
    assert plan.resident_layers > 0 and plan.memory.host_bytes <= budget.host_bytes
    assert plan.memory.device_bytes + H100.library_reserve_bytes <= budget.device_bytes
