"""The AdamW of a step that does not clip, inside its own last round (Engine(backward_update=
True), dataflow.memplan.step.compile's update='backward'): each streamed layer's update runs from its weight
and gradient slots right after its last backward, and the numbers are the bits of updating at
the end of each step, on every forced executor path and with layer segments, with the schedule
sanitizer on. A clipped step falls back to the deferred update, and the two modes alternate."""

from __future__ import annotations

import pytest

from dataflow.engine import Engine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.step.compile import Update, compile_schedule
from dataflow.models.config import load_config
from tests.dataflow.plans import path_plans, split_plans
from tests.dataflow.test_deferred_update import _batches, _same_state

CASES = path_plans(load_config("tiny")) + split_plans(load_config("tiny"))


def _run(plan, backward: bool, clips=(None, None, None), sanitize_seed=0):
    # no clipping in the constructor (backward_update cannot clip); steps pass their own
    opt = AdamWConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=None)
    with Engine.from_plan(plan, backend="numpy", sanitize=True, sanitize_seed=sanitize_seed,
                          optimizer=opt, deferred_update=backward,
                          backward_update=backward) as eng:
        results = [eng.train_step(b, max_grad_norm=c) for b, c in zip(_batches(plan), clips)]
        return [(r.loss, r.grad_norm) for r in results], eng.state_dict()


@pytest.mark.parametrize("name,plan", CASES, ids=[c[0] for c in CASES])
def test_update_in_the_last_round_is_the_bits_of_updating_at_the_end(name, plan):
    """Three unclipped steps each way: the same losses and gradient norms, and the same
    weights, m, v and step count, bit for bit."""
    eager_results, eager_state = _run(plan, False)
    results, state = _run(plan, True, sanitize_seed=1)
    assert results == eager_results, name
    _same_state(state, eager_state, name)


def test_clipped_and_unclipped_steps_alternate():
    """Steps clipped, unclipped, clipped: the deferred update of step 1 runs before step 2's
    own update in its last round, step 3 defers again; the bits of updating at the end."""
    name, plan = path_plans(load_config("tiny"))[-1]
    clips = (0.05, None, 0.05)
    eager_results, eager_state = _run(plan, False, clips)
    results, state = _run(plan, True, clips, sanitize_seed=2)
    assert results == eager_results
    _same_state(state, eager_state, name)


def test_layer_segments_update_in_the_last_round_bit_for_bit():
    """Layer-segment plans (the re-runs join the weight ring): packed and split."""
    from tests.dataflow.test_segments import SEGMENTS, _exact, _plans

    for name, plan in _plans().items():
        seg = _exact(plan, SEGMENTS[name])
        eager_results, eager_state = _run(seg, False)
        results, state = _run(seg, True, sanitize_seed=1)
        assert results == eager_results, name
        _same_state(state, eager_state, name)


def test_streamed_layers_update_before_the_last_round_ends():
    """Every streamed layer's AdamW (weights and gradients at home, optimizer streamed) is in
    the last round and reads its weight and gradient slots; the embedding and head update
    after it; nothing updates in an earlier round."""
    plan = path_plans(load_config("tiny"))[-1][1]  # streamed layers and head, host embedding
    sch = compile_schedule(plan, update="backward")
    last = sch.round_starts[-1]
    assert all(type(e) is not Update for e in sch.events[:last])
    inside = [e for e in sch.events[last:sch.optimizer_start] if type(e) is Update]
    assert {e.block for e in inside} == {f"layer{i}" for i in range(plan.model.n_layers)}
    assert all(e.params.region == "weight_slots" and e.grads.region == "grad_slots"
               for e in inside)
    after = {e.block for e in sch.events[sch.optimizer_start:] if type(e) is Update}
    assert after == {"embed", "head"}


def test_a_ring_refuses_the_update_in_the_backward():
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.search.ring_plan import make_rank_plans
    from dataflow.memplan.step.ring_compile import compile_ring_schedule
    from dataflow.memplan.plan.profiles import get_profile

    rps = make_rank_plans(load_config("tiny"), 256, Budget.from_gib(1, 1), get_profile("cpu"), 2)
    with pytest.raises(ValueError, match="one device"):
        compile_ring_schedule(rps[0], update="backward")


def test_the_prediction_simulates_the_last_round_apart():
    """predict_schedule(update='backward') times a first, a middle and a last round (the last
    carries the updates) and repeats only the middle one: 8b at 8k on 80/24, 40 rounds a step,
    is then no slower than updating at the end, where extrapolating the last round as the
    repeating one predicted 86 s against 69."""
    from dataflow.memplan.search.predict import predict_schedule
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile
    from dataflow.memplan.search.search import make_plan

    prof = get_profile("h100")
    plan = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), prof)
    assert plan.chunking.rounds_per_step > 3
    inround = predict_schedule(plan, prof, update="backward")
    end = predict_schedule(plan, prof, update="end")
    assert inround.step_time_s <= end.step_time_s
    assert inround.h2d_bytes < end.h2d_bytes  # no gradient comes back for the update
