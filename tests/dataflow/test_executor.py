"""The executor's numerical contract on the NumPy backend with the schedule sanitizer on: every
path matches the reference trainer within bf16 tolerance, placement-only changes are
bit-identical, the arenas are exactly the budgets, and a removed event is caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.backend import Place
from dataflow.backends.sanitizer import ScheduleRace
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.executor import Executor
from dataflow.memplan.step.events import VOCAB_HEAD_OPS, Compute, ComputeOp, HostOp, HostTask
from dataflow.memplan.step.compile import Schedule, compile_schedule
from dataflow.optimizer import AdamWConfig
from dataflow.reference_trainer import ReferenceTrainer
from dataflow.models.config import load_config
from dataflow.models.init import init_model
from dataflow.memplan.plan.plan import OptimizerWhere, Where
from dataflow.models.flops import SavedLevel
from tests.dataflow.plans import forced_plan, path_plans, split_plans, streamed

LR = 1e-3
STEPS = 2


def _batches(plan, steps=STEPS):
    ch, cfg = plan.chunking, plan.model
    return [token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                         start=s * ch.seqs_per_step * ch.seqlen) for s in range(steps)]


def _train(plan, seed=0, sanitize=True, sanitize_seed=0):
    eng = Engine.from_plan(plan, backend="numpy", seed=seed, sanitize=sanitize,
                           sanitize_seed=sanitize_seed,
                           optimizer=AdamWConfig(lr=LR, max_grad_norm=None))  # as the reference
    with eng:
        losses = [eng.train_step(b).loss for b in _batches(plan)]
        mem = (eng.be.memory_used_bytes(Place.DEVICE), eng.be.memory_used_bytes(Place.HOST))
        return losses, eng.weights(), mem


def _reference(plan, seed=0):
    cfg = plan.model
    ref = ReferenceTrainer(cfg, init_model(cfg, seed), lr=LR)
    losses = [ref.train_step(b).loss_mean for b in _batches(plan)]
    return losses, ref


def _blocks(w):
    return [w.embed, *w.layers, w.head]


@pytest.fixture(scope="module")
def tiny_runs():
    cfg = load_config("tiny")
    return {name: (plan, _train(plan, sanitize_seed=i))
            for i, (name, plan) in enumerate(path_plans(cfg) + split_plans(cfg))}


def test_every_path_matches_reference_trainer_within_bf16_tolerance(tiny_runs):
    """Loss within 1e-2 relative and parameter updates within 5 % (relative L2 of the update)
    of the fp32-accumulating reference trainer after two steps, for every forced path."""
    refs = {}
    for name, (plan, (losses, weights, _)) in tiny_runs.items():
        key = plan.chunking
        if key not in refs:
            refs[key] = _reference(plan)
        ref_losses, ref = refs[key]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2, err_msg=name)
        init = init_model(plan.model, 0)
        for got, want, start in zip(_blocks(weights), ref.blocks, _blocks(init)):
            d_got = got.astype(np.float64) - start.astype(np.float64)
            d_want = want.astype(np.float64) - start.astype(np.float64)
            err = np.linalg.norm(d_got - d_want) / np.linalg.norm(d_want)
            assert err < 0.05, f"{name}: update differs from reference by {err:.3%}"


def test_placement_only_changes_are_bit_identical(tiny_runs):
    """Plans sharing a chunking differ only in placement, prefetch depth or saved level, so their
    parameters after two steps are equal bit for bit."""
    groups = {}
    for name, (plan, (losses, weights, _)) in tiny_runs.items():
        groups.setdefault(plan.chunking, []).append((name, losses, weights))
    for members in groups.values():
        base_name, base_losses, base = members[0]
        for name, losses, w in members[1:]:
            assert losses == base_losses, f"{name} vs {base_name}"
            for a, b in zip(_blocks(w), _blocks(base)):
                assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name} vs {base_name}"


def test_arenas_are_the_device_budget_and_the_host_regions(tiny_runs):
    """The backend's own counters show one device slab of the budget less the libraries'
    reserve, and one host slab of the plan's host regions rounded up to whole 2 MiB pages,
    within the host budget (nothing pinned that no region uses)."""
    from dataflow.arena import SLAB_ROUND_BYTES
    from dataflow.memplan.plan.buffers import align
    from dataflow.memplan.step.compile import compile_schedule

    for name, (plan, (_, _, (dev, host))) in tiny_runs.items():
        assert dev == plan.budget.device_bytes - plan.profile.library_reserve_bytes, name
        regions = sum(align(r.nbytes) for r in compile_schedule(plan).regions.host)
        assert host % SLAB_ROUND_BYTES == 0 or host == plan.budget.host_bytes, name
        assert regions <= host < regions + SLAB_ROUND_BYTES, name
        assert host <= plan.budget.host_bytes, name


def test_small_model_split_and_packed_match_reference():
    """The `small` model (4 layers, d 256) on a packed and a split plan tracks the reference.
    Without the schedule sanitizer: the `tiny` runs above check these same plans' schedules
    under it, and on `small` it took 88 of this test's 90 s (2-core machine, twenty-first session)."""
    cfg = load_config("small")
    for name, plan in [path_plans(cfg)[2], split_plans(cfg)[1]]:
        losses, weights, _ = _train(plan, sanitize=False)
        ref_losses, _ = _reference(plan)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2, err_msg=name)


def test_sanitizer_catches_a_removed_event():
    """Dropping the compute stream's wait on a weight prefetch from the compiled schedule makes
    the sanitizer report a race that names both ops."""
    from dataflow.memplan.step.compile import Fetch, Record, Wait, compile_schedule

    cfg = load_config("tiny")
    plan = path_plans(cfg)[2][1]
    sch = compile_schedule(plan)
    events = list(sch.events)
    # The record right after the first weight fetch, and the compute stream's wait on it.
    at = next(i for i, e in enumerate(events) if type(e) is Fetch and e.name.startswith("w.h2d"))
    rec = events[at + 1]
    assert type(rec) is Record and rec.stream == "h2d"
    drop = next(i for i, e in enumerate(events)
                if type(e) is Wait and e.id == rec.id and e.stream == "compute")
    broken = dataclasses.replace(sch, events=tuple(events[:drop] + events[drop + 1:]),
                                 optimizer_start=sch.optimizer_start - 1)
    eng = Engine.from_plan(plan, backend="numpy", sanitize=True, schedule=broken,
                           optimizer=AdamWConfig(lr=LR))
    with eng, pytest.raises(ScheduleRace) as info:
        eng.train_step(_batches(plan, 1)[0])
    assert "h2d" in str(info.value) and info.value.first and info.value.second


def test_rounds_reusing_held_weights_are_bit_identical_to_resident():
    """Four rounds a step, so rounds 1 and 2.. take their own slot assignments (the layers and
    head the last backward left in their slots are not fetched again): with streamed layers
    over 1 and 2 slots, a streamed head and a HOME embedding, two steps under the sanitizer
    give parameters bit-identical to the all-resident plan of the same chunking."""
    cfg = load_config("tiny")
    common = dict(chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=1, rounds=4)
    n, strm = cfg.n_layers, streamed(OptimizerWhere.STREAMED)
    base_losses, base, _ = _train(forced_plan(cfg, 64, **common))
    for slots in (1, 2):
        plan = forced_plan(cfg, 64, layers=(strm,) * n, weight_slots=slots, head=strm,
                           embed=streamed(OptimizerWhere.HOST), **common)
        losses, w, _ = _train(plan, sanitize_seed=slots)
        assert losses == base_losses, slots
        for a, b in zip(_blocks(w), _blocks(base)):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), slots


def test_two_split_sequences_a_round_refill_the_context_row_by_row():
    """Two sequences of 128 tokens in 2 chunks each per round: the next sequence's and the
    next layer's context rows are queued as the backward frees them. Home and device-resident
    chunks mixed, streamed layers, under the sanitizer: bit-identical to all-resident."""
    cfg = load_config("tiny")
    n = cfg.n_layers
    common = dict(chunk_tokens=64, chunks_per_seq=2, chunks_per_round=4, rounds=2)
    base_losses, base, _ = _train(forced_plan(cfg, 128, **common))
    levels = [[SavedLevel.INP_ONLY, SavedLevel.FULL, SavedLevel.INP_ATTN, SavedLevel.INP_ONLY]] * n
    for rebuild in (False, True):  # K/V fetched from their home copies, or re-formed from x
        plan = forced_plan(cfg, 128, layers=(streamed(OptimizerWhere.STREAMED),) * n,
                           levels=levels, homes=[[Where.HOME, Where.DEVICE, Where.HOME,
                                                  Where.HOME]] * n, kv_rebuild=rebuild, **common)
        losses, w, _ = _train(plan, sanitize_seed=3)
        assert losses == base_losses, rebuild
        for a, b in zip(_blocks(w), _blocks(base)):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), rebuild


def test_every_op_has_one_handler_and_the_schedule_json_keeps_its_strings():
    """The executor maps every ComputeOp (but the ring's vocabulary-parallel head's, which
    RingExecutor maps: tests/ring/test_ring_vocab_head.py) and HostOp to a handler; a compiled
    schedule's events
    hold the enums, its JSON spells them as the strings it always did, and the JSON round trip
    gives the same events and the same text."""
    cfg = load_config("tiny")
    plan = dict(path_plans(cfg))["embed_head_at_home"]
    with Engine.from_plan(plan, backend="numpy") as eng:
        assert isinstance(eng.ex, Executor)
        assert set(eng.ex._compute_ops) == set(ComputeOp) - VOCAB_HEAD_OPS
        assert set(eng.ex._host_ops) == set(HostOp)
    sch = compile_schedule(plan)
    ops = [e.op for e in sch.events if type(e) in (Compute, HostTask)]
    assert all(type(op) in (ComputeOp, HostOp) for op in ops)
    assert {HostOp.EMBED_GATHER, HostOp.EMBED_SCATTER, ComputeOp.HEAD} <= set(ops)
    text = sch.to_json()
    assert '"op": "layer_fwd"' in text and "ComputeOp" not in text
    again = Schedule.from_json(text)
    assert again.events == sch.events and again.to_json() == text
    assert Compute("c", "layer_bwd", 0).op is ComputeOp.LAYER_BWD
    with pytest.raises(ValueError, match="unknown ComputeOp 'layer_fw'; known: layer_fwd"):
        Compute("c", "layer_fw", 0)
