"""Layer-segment recompute on the NumPy backend with the schedule sanitizer on: plans whose
segments rebuild inner activations (k = 2 and k = n_layers, packed and split sequences,
rebuilt activations at home and on the device) give parameters bit-identical to the same plan
without segments (the recompute runs the forward's kernels in the forward's order) and so track
the reference trainer; the arenas are exactly the budgets."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from dataflow.memplan.plan.plan import Budget, OptimizerWhere, Where
from dataflow.memplan.search.build import with_segments
from dataflow.models.config import load_config
from dataflow.models.flops import SavedLevel
from tests.dataflow.plans import forced_plan, streamed
from tests.dataflow.test_executor import _blocks, _reference, _train

N_LAYERS = 4
SEGMENTS = {"packed": N_LAYERS, "split": 2}


def _cfg():
    """tiny with four layers, so k = 2 and k = n_layers differ."""
    return dataclasses.replace(load_config("tiny"), n_layers=N_LAYERS)


def _reserve(plan) -> int:
    """Device bytes the libraries hold beside the arena (none on the NumPy backend's count)."""
    return getattr(plan.profile, "library_reserve_bytes", 0)


def _exact(plan, k: int):
    """`plan` with segments of k and budgets equal to what that needs."""
    big = with_segments(plan, k, Budget(host_bytes=1 << 32, device_bytes=1 << 32))
    return with_segments(plan, k, Budget(
        host_bytes=big.memory.host_bytes,
        device_bytes=big.memory.device_bytes + _reserve(plan)))


def _plans():
    cfg, n = _cfg(), N_LAYERS
    strm = streamed(OptimizerWhere.STREAMED)
    packed = forced_plan(
        cfg, 64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2, rounds=1,
        layers=(strm,) * n, weight_slots=2, grad_slots=2, act_slots=2,
        levels=[[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN], [SavedLevel.FULL,
                                                             SavedLevel.INP_ONLY]] * 2,
        homes=[[Where.HOME, Where.DEVICE], [Where.HOME, Where.HOME]] * 2)
    split = forced_plan(
        cfg, 256, chunk_tokens=64, chunks_per_seq=4, chunks_per_round=4, rounds=1,
        layers=(strm,) * n, act_slots=2,
        levels=[[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN, SavedLevel.FULL,
                 SavedLevel.INP_ONLY]] * n,
        homes=[[Where.HOME, Where.DEVICE, Where.HOME, Where.HOME]] * n)
    return {"packed": packed, "split": split}


@pytest.fixture(scope="module")
def runs():
    """Packed with k = n_layers, split with k = 2 (two segments reusing the rebuilt storage,
    whose K/V also refill the context), each beside its segment-free plan (the
    NumPy reference kernels are slow enough that four runs is the budget here)."""
    out = {}
    for i, (name, plan) in enumerate(_plans().items()):
        k = SEGMENTS[name]
        out[(name, 1)] = (plan, _train(plan, sanitize_seed=i))
        out[(name, k)] = (_exact(plan, k), _train(_exact(plan, k), sanitize_seed=i + k))
    return out


def test_segment_plans_are_bit_identical_to_the_plan_without_segments(runs):
    """k = n_layers (packed) and k = 2 (split): losses and parameters after two steps equal the
    segment-free plan's bit for bit."""
    for (name, k), (plan, (losses, weights, _)) in runs.items():
        assert plan.segment_layers == k
        base_losses, base = runs[(name, 1)][1][:2]
        assert losses == base_losses, (name, k)
        for a, b in zip(_blocks(weights), _blocks(base)):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (name, k)


def test_segment_plans_match_reference_trainer_within_bf16_tolerance(runs):
    """Loss within 1e-2 relative of the fp32-accumulating reference trainer."""
    for name, k in SEGMENTS.items():
        plan, (losses, _, _) = runs[(name, k)]
        ref_losses, _ = _reference(plan)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2, err_msg=f"{name} k={k}")


def test_segment_plans_use_exactly_their_budgets_and_less_host(runs):
    """The device arena is the budget, the host arena the plan's host memory within the
    budget, and rebuilding inner activations needs no more host memory for saved activations
    than keeping them all (less at k = 2)."""
    for (name, k), (plan, (_, _, (dev, host))) in runs.items():
        assert dev == plan.budget.device_bytes - _reserve(plan)
        assert plan.memory.host_bytes <= host <= plan.budget.host_bytes
        if k > 1:
            base = runs[(name, 1)][0]
            acts = dict(plan.memory.host)["saved_activations"]
            full = dict(base.memory.host)["saved_activations"]
            # k kept + k - 1 rebuilt layers' worth: less than all four at k = 2, as much at 4
            assert acts < full if k == 2 else acts <= full, (name, k)


def test_split_boundaries_kept_at_home_leave_their_kv_to_one_shared_region(runs):
    """A split sequence's boundary kept at home at INP_ONLY stores x and rstd only; the
    recompute sends its re-formed K/V to home.ctx_kv and the backward refills from there (the
    bit-identity test above runs it). Other levels, device-homed chunks and inner layers keep
    theirs; packed chunks (no context to refill) too."""
    from dataflow.memplan.plan.buffers import align, saved_activation_bytes
    from dataflow.memplan.plan.memory import host_regions
    from dataflow.memplan.step.compile import compile_schedule

    plan = runs[("split", 2)][0]
    cfg, ch = plan.model, plan.chunking
    host = dict(host_regions(plan))
    assert host["home.ctx_kv"] == align(2 * ch.tokens_per_round * cfg.n_kv_heads
                                        * cfg.head_dim * 2)
    inp = SavedLevel.INP_ONLY
    for c in (0, 3):
        assert host[f"home.act.0.{c}"] == saved_activation_bytes(cfg, ch.chunk_tokens, inp,
                                                                 kv=False)
    assert host["home.act.0.2"] == saved_activation_bytes(cfg, ch.chunk_tokens,
                                                          SavedLevel.FULL)
    names = {getattr(ev, "name", "") for ev in compile_schedule(plan).events}
    assert {"ctx.k.store.c0", "ctx.v.store.c3"} <= names
    assert "ctx.k.store.c2" not in names and "ctx.k.store.c1" not in names
    assert "home.ctx_kv" not in dict(host_regions(runs[("packed", N_LAYERS)][0]))


def _two_sequence_split_plan():
    """Two split sequences per round (the recompute re-forms the second sequence's context over
    the first's rows), every chunk kept at home at INP_ONLY: all boundaries share their K/V."""
    cfg, n = _cfg(), N_LAYERS
    strm = streamed(OptimizerWhere.STREAMED)
    return forced_plan(
        cfg, 128, chunk_tokens=64, chunks_per_seq=2, chunks_per_round=4, rounds=1,
        layers=(strm,) * n, act_slots=2, levels=[[SavedLevel.INP_ONLY] * 4] * n,
        homes=[[Where.HOME] * 4] * n)


def test_shared_boundary_kv_is_ordered_and_bit_identical_with_two_sequences_a_round(monkeypatch):
    """No two accesses to the same bytes of home.ctx_kv (the K/V copies home, the refills) are
    unordered across two steps; and training under the sanitizer (two seeds) equals the plan
    without segments bit for bit."""
    from dataflow.memplan.step.compile import compile_schedule
    from tests.dataflow import test_embed_rows

    base = _two_sequence_split_plan()
    plan = _exact(base, 2)
    sch = compile_schedule(plan)
    assert sum(getattr(ev, "name", "").startswith("ctx.k.store") for ev in sch.events) == 2 * 4
    monkeypatch.setattr(test_embed_rows, "ROWS", "home.ctx_kv")
    assert test_embed_rows.unordered_row_accesses(sch.events, sch.n_ids) == []
    want_losses, want = _train(base, sanitize_seed=3)[:2]
    for seed in (5, 6):
        losses, weights, _ = _train(plan, sanitize_seed=seed)
        assert losses == want_losses, seed
        for a, b in zip(_blocks(weights), _blocks(want)):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), seed


def test_a_boundary_that_kept_its_attention_output_is_re_run_without_attention():
    """The split k = 2 plan's boundaries (layers 0 and 2) keep chunks 1 and 2 at INP_ATTN and
    FULL: their re-run launches no attention and no Q projection but still forms K/V (chunk 3,
    at INP_ONLY, attends to them); chunks 0 and 3 and the inner layers run the whole forward.
    (Their bits: test_segment_plans_are_bit_identical_to_the_plan_without_segments.)"""
    from dataflow.engine import Engine
    from tests.dataflow.test_executor import _batches

    plan = _exact(_plans()["split"], 2)
    eng = Engine.from_plan(plan, backend="numpy", seed=0)
    names, launch = [], eng.be.launch

    def recording(stream, op, *args, name=None, **kw):
        names.append(name)
        return launch(stream, op, *args, name=name, **kw)

    eng.be.launch = recording
    with eng:
        eng.train_step(_batches(plan)[0])
    count = collections.Counter(names)
    for layer in range(N_LAYERS):
        for c, a in enumerate(plan.activations[layer]):
            tag = f"b.L{layer}.c{c}.seg"
            kept = layer % 2 == 0 and a.level in (SavedLevel.INP_ATTN, SavedLevel.FULL)
            assert count[f"{tag}.attention_fwd"] == (not kept), (layer, c)
            # Q, K, V, O, gate, up, down; without Q when kept. RoPE on Q and K; on K when kept.
            assert count[f"{tag}.linear_fwd"] == 7 - kept, (layer, c)
            assert count[f"{tag}.rope_fwd"] == 2 - kept, (layer, c)
