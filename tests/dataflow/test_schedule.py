"""The compiled schedule is the one list everybody uses: the simulator times it, the executor
dispatches it (checked on the null backend, which replays 8b at 8192 tokens without memory or
compute), it round-trips through JSON, and its regions stay inside the budgets."""

from __future__ import annotations

import time

import numpy as np

from dataflow.backends import make_backend
from dataflow.executor import Executor
from dataflow.optimizer import AdamW, AdamWConfig
from dataflow.memplan import make_plan
from dataflow.memplan.search.cost import event_seconds
from dataflow.memplan.plan.plan import Budget, Where
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.step.compile import (Compute, Fetch, Record, Schedule, Wait, WriteBack,
                              compile_schedule)
from dataflow.memplan.step.sim import simulate_schedule
from dataflow.models.config import load_config
from tests.dataflow.plans import path_plans, split_plans


def _replay(plan, schedule):
    be = make_backend("null")
    ex = Executor(plan, be, schedule)
    ex.dispatched = []
    batch = np.zeros((plan.chunking.seqs_per_step, plan.chunking.seqlen + 1), np.int32)
    ex.step(batch, AdamW(AdamWConfig()))
    return ex, be


def test_simulated_and_dispatched_lists_are_the_same_list_for_8b():
    """8b at 8192 on an H100 profile (40 rounds, streamed weights, grads and activations): the
    executor dispatches exactly the events the simulator timed, in order, in about a second,
    and the backend saw one record / wait / copy per such event."""
    profile = get_profile("h100")
    plan = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), profile)
    sch = compile_schedule(plan)
    timeline = simulate_schedule(sch, event_seconds(plan, profile), profile)
    t0 = time.perf_counter()
    ex, be = _replay(plan, sch)
    assert time.perf_counter() - t0 < 5.0
    assert ex.dispatched == list(timeline.events)
    assert len(ex.dispatched) == len(sch.events) > 10_000
    kinds = [c[0] for c in be.calls]
    assert kinds.count("record") == sum(type(e) is Record for e in sch.events)
    assert kinds.count("wait") == sum(type(e) is Wait for e in sch.events)
    step_copies = sum(c[0] == "copy" and c[2] != "upload" for c in be.calls)  # not setup
    assert step_copies == sum(type(e) in (Fetch, WriteBack) for e in sch.events)
    assert len(timeline.round_end_s) == plan.chunking.rounds_per_step
    assert 0 < timeline.compute_busy_s <= timeline.total_s


def test_every_wait_follows_its_record_and_every_compute_names_its_bytes():
    """On every forced tiny plan: ids are recorded before they are waited on, and every compute
    event's weights, grads and saved-activation ranges lie inside a region of the table."""
    cfg = load_config("tiny")
    for name, plan in path_plans(cfg) + split_plans(cfg):
        sch = compile_schedule(plan)
        seen = set()
        sizes = {r.name: r.nbytes for r in sch.regions.device + sch.regions.host}
        for ev in sch.events:
            if type(ev) is Record:
                seen.add(ev.id)
            elif type(ev) is Wait:
                assert ev.id in seen, name
            for ref in (getattr(ev, f, None) for f in ("weights", "grads", "save", "dst", "src")):
                if ref is not None and not isinstance(ref, str):
                    assert ref.offset + ref.nbytes <= sizes[ref.region], (name, ev)
        assert any(type(e) is Compute and e.op == "layer_bwd" for e in sch.events), name


def test_schedule_round_trips_through_json():
    plan = split_plans(load_config("tiny"))[0][1]
    sch = compile_schedule(plan)
    again = Schedule.from_json(sch.to_json())
    assert again == sch


def test_regions_fill_at_most_the_budgets():
    for name, plan in path_plans(load_config("tiny")):
        table = compile_schedule(plan).regions
        assert table.used_bytes("device") <= plan.budget.device_bytes, name
        assert table.used_bytes("host") <= plan.budget.host_bytes, name


def test_schedule_prediction_adds_up_and_counts_state_bytes_only():
    """predict_schedule: step = compute + recompute + exposed + optimizer exactly; an all-resident
    plan moves no state bytes and waits only for the round's token ids; a plan streaming its
    weights predicts more exposed copy time."""
    from dataflow.memplan.search.predict import predict_schedule
    from tests.memplan.forced import forced

    h100 = get_profile("h100")
    resident = predict_schedule(forced(h100, "small", 512, chunk_tokens=512, rounds=4), h100)
    assert resident.h2d_bytes == 0 and resident.d2h_bytes == 0 and resident.recompute_s == 0
    assert resident.exposed_h2d_s < 0.01 * resident.step_time_s
    for pr in (resident, predict_schedule(
            make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), h100), h100)):
        parts = (pr.compute_s + pr.recompute_s + pr.exposed_h2d_s + pr.exposed_d2h_s
                 + pr.optimizer_s)
        assert abs(pr.step_time_s - parts) <= 1e-9 * pr.step_time_s
    assert pr.h2d_bytes > 0 and pr.exposed_h2d_s > resident.exposed_h2d_s


def test_later_rounds_reuse_the_weights_the_last_backward_left_in_slots():
    """8b at 8192 (80/24: 32 streamed layers over 4 weight slots, a streamed head): each round
    after the first opens its forward with the layers the round before ended its backward on,
    still in their slots, so it fetches one per slot fewer, and the head weights cross once
    per step, not once per round. The weights do not change within a step, so nothing is
    read stale (the sanitizer tests check the order on tiny plans)."""
    profile = get_profile("h100")
    plan = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), profile)
    sch = compile_schedule(plan)
    assert sch.rounds >= 3 and plan.head.weights is Where.HOME
    bounds = list(sch.round_starts) + [sch.optimizer_start]
    rounds = [sch.events[a:b] for a, b in zip(bounds, bounds[1:])]
    layer = [[e.name for e in r if type(e) is Fetch and e.name.startswith("w.")] for r in rounds]
    head = [sum(type(e) is Fetch and e.name.startswith("headw.") for e in r) for r in rounds]
    slots = plan.slots.weight_slots
    assert all(len(later) == len(layer[0]) - slots for later in layer[1:])
    assert not {f"w.h2d{i}" for i in range(slots)} & set(layer[1][:slots])
    assert head == [1] + [0] * (sch.rounds - 1)
