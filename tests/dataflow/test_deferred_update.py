"""The deferred AdamW (Engine(deferred_update=True), the default): a step's update runs inside the
next step's round 0 or when the model is read, and the numbers are the bits of updating at the end
of each step, on every forced executor path, with the schedule sanitizer on."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.step.compile import Update, compile_schedule, compile_update_schedule
from dataflow.models.config import load_config
from dataflow.models.errors import NonFiniteError
from tests.dataflow.plans import path_plans, split_plans, updated_pieces

STEPS = 3


def _batches(plan, steps=STEPS):
    ch, cfg = plan.chunking, plan.model
    return [token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                         start=s * ch.seqs_per_step * ch.seqlen) for s in range(steps)]


def _run(plan, deferred: bool, clip=None, sanitize_seed=0):
    opt = AdamWConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    with Engine.from_plan(plan, backend="numpy", sanitize=True, sanitize_seed=sanitize_seed,
                          optimizer=opt, deferred_update=deferred) as eng:
        results = [eng.train_step(b) for b in _batches(plan)]
        return [(r.loss, r.grad_norm) for r in results], eng.state_dict()


def _same_state(a: dict, b: dict, name: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.atleast_1d(np.asarray(a[k])), np.atleast_1d(np.asarray(b[k]))
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name}: {k} differs"


_TINY = path_plans(load_config("tiny"))
CASES = [(name, plan, None) for name, plan in _TINY + split_plans(load_config("tiny"))] \
    + [(name + "_clipped", plan, 0.05) for name, plan in _TINY[1:3] + _TINY[-1:]]


@pytest.mark.parametrize("name,plan,clip", CASES, ids=[c[0] for c in CASES])
def test_deferred_update_is_the_bits_of_updating_at_the_end(name, plan, clip):
    """Three steps each way: the same losses and gradient norms, and after the last step the same
    weights, m, v and step count, bit for bit (clipping on for a few paths, at a norm the
    gradients exceed, so the scale the deferred updates read is not 1)."""
    eager_results, eager_state = _run(plan, False, clip)
    lazy_results, lazy_state = _run(plan, True, clip, sanitize_seed=1)
    assert lazy_results == eager_results, name
    if clip is not None:
        assert all(norm > clip for _, norm in eager_results), "clipping never engaged"
    _same_state(lazy_state, eager_state, name)


def test_deferred_update_with_layer_segments_is_the_bits_of_updating_at_the_end():
    """Layer-segment plans (the backward re-runs each segment's forward, whose weight uses
    join the ring): packed with one segment of all layers, split with segments of 2."""
    from tests.dataflow.test_segments import SEGMENTS, _exact, _plans

    for name, plan in _plans().items():
        seg = _exact(plan, SEGMENTS[name])
        assert seg.segment_layers > 1
        eager_results, eager_state = _run(seg, False, 0.05)
        lazy_results, lazy_state = _run(seg, True, 0.05, sanitize_seed=1)
        assert lazy_results == eager_results, name
        _same_state(lazy_state, eager_state, name)


def test_round_zero_carries_every_update_and_the_tail_none():
    """The deferred step's list holds one AdamW over every element of every block, all before
    round 1, none after its last round; the update schedule alone covers them too."""
    plan = path_plans(load_config("tiny"))[-1][1]  # streamed layers and head, host embedding
    sch = compile_schedule(plan, update="deferred")
    assert all(type(e) is not Update for e in sch.events[sch.round_starts[1]:])
    for events in (sch.events[:sch.round_starts[1]], compile_update_schedule(plan).events):
        counted: dict[str, int] = {}
        for e in events:
            if type(e) is Update:
                counted[e.block] = counted.get(e.block, 0) + e.count
        want = {f"layer{i}" for i in range(plan.model.n_layers)} | {"embed", "head"}
        assert set(counted) == want
    fused = [e for e in sch.events[:sch.round_starts[1]]
             if type(e) is Update and e.params.region == "weight_slots"]
    assert fused, "no streamed layer's update wrote into its weight slot"


def test_reads_evaluations_and_writes_see_the_updated_model():
    """weights(), eval_step and write_block after a deferred step behave as after an eager one:
    the pending update runs first, and a written block is not overwritten by it later."""
    plan = path_plans(load_config("tiny"))[2][1]
    batch = _batches(plan, 1)[0]
    out = {}
    for deferred in (False, True):
        with Engine.from_plan(plan, backend="numpy", optimizer=AdamWConfig(lr=1e-3),
                              deferred_update=deferred) as eng:
            eng.train_step(batch)
            assert eng.ex.update_pending is deferred
            loss = eng.eval_step(batch)
            assert not eng.ex.update_pending
            eng.train_step(batch)
            ref = eng.block_refs()[1]
            written = np.full(eng.layout(ref).numel, 0.5, dtype=eng.read_block(ref).dtype)
            eng.write_block(ref, written)
            back = eng.read_block(ref)
            out[deferred] = (loss, eng.weights(), back)
    assert out[True][0] == out[False][0]
    assert np.array_equal(out[True][2], out[False][2])
    for a, b in zip([out[True][1].embed, *out[True][1].layers, out[True][1].head],
                    [out[False][1].embed, *out[False][1].layers, out[False][1].head]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_a_non_finite_step_drops_its_deferred_update():
    """Step 1 at a huge lr: its update lands inside step 2's round 0 and makes step 2's loss
    non-finite. Step 2's own update is then dropped, so the weights are those after step 1
    exactly, which the eager engine shows between its steps 1 and 2."""
    plan = path_plans(load_config("tiny"))[2][1]
    batches = _batches(plan, 2)
    with Engine.from_plan(plan, backend="numpy", optimizer=AdamWConfig(lr=1e-3),
                          deferred_update=False) as eng:
        eng.train_step(batches[0], lr=1e30)
        want = eng.weights()
    with Engine.from_plan(plan, backend="numpy", optimizer=AdamWConfig(lr=1e-3)) as eng:
        eng.train_step(batches[0], lr=1e30)
        with pytest.raises(NonFiniteError):
            eng.train_step(batches[1])
        assert not eng.ex.update_pending
        got = eng.weights()
    for a, b in zip([got.embed, *got.layers, got.head], [want.embed, *want.layers, want.head]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("model,seqlen,host,dev", [
    ("8b", 262144, 120, 24),  # layer segments of 4, one round a step
    ("1b", 1 << 20, 120, 24),  # K/V re-formed from x, one round a step
    ("15b", 8192, 112, 24),  # every block streamed, 67 rounds a step
])
def test_real_plans_place_every_deferred_update_exactly_once(model, seqlen, host, dev):
    """The planner's own plans for long and large cells compile deferred (two rounds, or the
    one a step has): round 0 updates every element of every block once, as many as the update
    schedule alone does, and nothing updates after round 0."""
    from dataflow.memplan import get_profile, make_plan
    from dataflow.memplan.plan.plan import Budget

    plan = make_plan(load_config(model), seqlen, Budget.from_gib(host, dev), get_profile("h100"))
    sch = compile_schedule(plan, rounds=min(2, plan.chunking.rounds_per_step), update="deferred")
    end = sch.round_starts[1] if len(sch.round_starts) > 1 else sch.optimizer_start
    assert all(type(e) is not Update for e in sch.events[end:])
    assert updated_pieces(sch.events[:end]) == updated_pieces(compile_update_schedule(plan).events)
