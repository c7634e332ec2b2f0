"""Frozen blocks on the NumPy backend with the schedule sanitizer on (issue 54, first step):
frozen weights come out of several steps bit-identical, the trained blocks track the reference
trainer given the same frozen set, and the compiled step holds no gradient, AdamW or gradient
copy event of a frozen block."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.memplan.plan.frozen import parse_freeze
from dataflow.memplan.plan.plan import Budget, OptimizerWhere, Where
from dataflow.memplan.search.build import with_segments
from dataflow.memplan.step.compile import Compute, Fetch, Update, WriteBack, compile_schedule
from dataflow.memplan.step.events import ComputeOp
from dataflow.models.config import load_config
from dataflow.models.flops import SavedLevel
from dataflow.models.init import init_model
from dataflow.optimizer import AdamWConfig
from dataflow.reference_trainer import ReferenceTrainer
from tests.dataflow.plans import RESIDENT, forced_plan, streamed

LR = 1e-3
STEPS = 3
PACKED = dict(chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2, rounds=2)


def _plan(name: str, spec: str):
    """Forced tiny plans over the executor's paths, with `spec` frozen."""
    cfg = load_config("tiny")
    n, frozen = cfg.n_layers, parse_freeze(spec, cfg.n_layers)
    host, strm = streamed(OptimizerWhere.HOST), streamed(OptimizerWhere.STREAMED)
    if name == "resident":
        return forced_plan(cfg, 64, frozen=frozen, **PACKED)
    if name == "streamed":
        return forced_plan(cfg, 64, layers=(strm,) * n, weight_slots=2, grad_slots=2,
                           frozen=frozen, **PACKED)
    if name == "home_ends":  # HOME embedding (host AdamW) and head, streamed layers, acts home
        return forced_plan(cfg, 64, layers=(strm, host), embed=host, head=strm,
                           homes=[[Where.HOME, Where.DEVICE]] * n, frozen=frozen, **PACKED)
    if name == "segments":  # one segment of both layers: the backward re-runs its forward
        plan = forced_plan(cfg, 64, layers=(strm,) * n, weight_slots=2, frozen=frozen,
                           homes=[[Where.HOME, Where.DEVICE]] * n, **PACKED)
        big = with_segments(plan, n, Budget(host_bytes=1 << 32, device_bytes=1 << 32))
        return with_segments(big, n, Budget(
            host_bytes=big.memory.host_bytes,
            device_bytes=big.memory.device_bytes + big.profile.library_reserve_bytes))
    levels = [[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN, SavedLevel.FULL,
               SavedLevel.INP_ONLY]] * n
    return forced_plan(cfg, 256, layers=(strm,) * n, levels=levels,  # split sequences
                       homes=[[Where.HOME, Where.DEVICE, Where.HOME, Where.HOME]] * n,
                       chunk_tokens=64, chunks_per_seq=4, chunks_per_round=4, rounds=2,
                       frozen=frozen)


CASES = [("resident", "embed,layers:0"), ("streamed", "head,layers:1"),
         ("home_ends", "embed,head,layers:0"), ("home_ends", "layers:1"),
         ("split", "embed,layers:0"), ("segments", "layers:1")]


def _batches(plan, seed: int):
    """Fresh random tokens per step (the seeded stream starts at a seed-dependent offset)."""
    ch, cfg = plan.chunking, plan.model
    start = 1 + seed * 7919
    return [token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                         start=start + s * ch.seqs_per_step * ch.seqlen) for s in range(STEPS)]


def _blocks(w):
    return [w.embed, *w.layers, w.head]


@pytest.mark.parametrize("name,spec", CASES)
def test_frozen_blocks_stay_bit_identical_and_trained_ones_track_the_reference(name, spec):
    """After three steps a frozen block's weights equal its initial bits; every trained block's
    update is within 5 % (relative L2) of the reference trainer's with the same frozen set (10 %
    for the embedding), and the losses within 1e-2.

    The embedding's bound is wider because its bf16 update is the noisiest of the blocks with or
    without frozen blocks: few tokens reach each row and AdamW's first steps scale every element
    to about +-lr, so near-zero gradients that round the other way flip whole steps. Measured on
    the streamed plan: 4.1-5.9 % over six seeds with `head,layers:1` frozen, 5.3-7.9 % with only
    the head frozen, 5.2 % at seed 54 on CI's CPU (4.7 % here)."""
    plan = _plan(name, spec)
    cfg, seed = plan.model, 54
    batches = _batches(plan, seed)
    eng = Engine.from_plan(plan, backend="numpy", seed=seed, sanitize=True, sanitize_seed=seed,
                           optimizer=AdamWConfig(lr=LR, max_grad_norm=None))
    with eng:
        losses = [eng.train_step(b).loss for b in batches]
        got = eng.weights()
    ref = ReferenceTrainer(cfg, init_model(cfg, seed), lr=LR, frozen=spec)
    ref_losses = [ref.train_step(b).loss_mean for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2, err_msg=f"{name} {spec} seed {seed}")
    init = init_model(cfg, seed)
    for i, (g, want, start, trains) in enumerate(zip(_blocks(got), ref.blocks, _blocks(init),
                                                   ref.trains)):
        if not trains:
            assert np.array_equal(g.view(np.uint16), start.view(np.uint16)), (name, spec, i)
            continue
        d_got = g.astype(np.float64) - start.astype(np.float64)
        d_want = want.astype(np.float64) - start.astype(np.float64)
        assert np.linalg.norm(d_want) > 0, (name, spec, i)
        err = np.linalg.norm(d_got - d_want) / np.linalg.norm(d_want)
        bound = 0.10 if i == 0 else 0.05
        assert err < bound, f"{name} {spec} block {i}: update differs by {err:.3%} (seed {seed})"


@pytest.mark.parametrize("name,spec", CASES)
def test_schedule_has_no_gradient_work_for_frozen_blocks(name, spec):
    """No AdamW Update, gradient write-back or gradient norm of a frozen block, and a frozen
    layer's backward (and a frozen head's) carries no gradient ref."""
    plan = _plan(name, spec)
    frozen = plan.frozen
    frozen_names = {f"layer{i}" for i in frozen.layers} | {k for k in ("embed", "head")
                                                          if frozen.block(k)}
    for update in ("end", "deferred"):
        sch = compile_schedule(plan, update=update)
        for e in sch.events:
            if type(e) is Update:
                assert e.block not in frozen_names, e
            if type(e) is WriteBack:
                assert not any(e.src.region.startswith(f"{b}.grads") or
                               e.dst.region.startswith(f"home.{b}.grads")
                               for b in frozen_names), e
            if type(e) is Compute and e.op is ComputeOp.LAYER_BWD:
                assert (e.grads is None) == frozen.layer(e.layer), e
            if type(e) is Compute and e.op is ComputeOp.HEAD:
                assert (e.grads is None) == frozen.head, e
            if type(e) is Compute and e.op is ComputeOp.EMBED_BWD:
                assert not frozen.embed, e
        names = {r.name for r in sch.regions.device + sch.regions.host}
        for b in frozen_names:
            assert not {f"{b}.grads", f"{b}.m", f"{b}.v", f"home.{b}.grads",
                        f"home.{b}.m", f"home.{b}.v"} & names, b


def test_a_plan_with_nothing_frozen_compiles_the_same_schedule():
    """An empty spec is no frozen set: the same plan, the same events."""
    a, b = _plan("home_ends", ""), forced_plan(load_config("tiny"), 64, layers=(
        streamed(OptimizerWhere.STREAMED), streamed(OptimizerWhere.HOST)),
        embed=streamed(OptimizerWhere.HOST), head=streamed(OptimizerWhere.STREAMED),
        homes=[[Where.HOME, Where.DEVICE]] * 2, **PACKED)
    assert a == b and a.hash == b.hash
    assert compile_schedule(a).to_json() == compile_schedule(b).to_json()
    assert RESIDENT.weights is Where.DEVICE


@pytest.mark.parametrize("name,spec", CASES)
def test_frozen_step_moves_exactly_the_frozen_blocks_gradient_and_optimizer_bytes_less(name,
                                                                                       spec):
    """Against the same plan trained whole, the frozen step's H2D and D2H bytes are less by
    exactly the full step's copies of the frozen blocks' gradients, their streamed AdamW pieces
    (weights, gradient, m, v in; weights, m, v out), a HOME table's gradient rows and the host
    part of its gradient norm; nothing else."""
    frozen, full = _plan(name, spec), _plan(name, "")
    f = frozen.frozen
    blocks = {f"layer{i}" for i in f.layers} | {k for k in ("embed", "head") if f.block(k)}

    def frozen_copy(e) -> bool:
        host = e.src if type(e) is Fetch else e.dst
        if any(host.region in (f"home.{b}.grads", f"home.{b}.m", f"home.{b}.v")
               for b in blocks):
            return True
        if any(e.name in (f"opt.h2d.{b}", f"opt.d2h.{b}") for b in blocks):
            # a deferred update fused into round 0's weight fetch (its H2D of the weights into
            # the slot the forward reads): the frozen layer still fetches those weights
            return not (type(e) is Fetch and e.dst.region == "weight_slots")
        return f.embed and e.name in ("embed.dx", "gnorm.embed")

    for update in ("end", "deferred"):
        a, b = compile_schedule(full, update=update), compile_schedule(frozen, update=update)
        h2d = sum(e.dst.nbytes for e in a.events if type(e) is Fetch and frozen_copy(e))
        d2h = sum(e.dst.nbytes for e in a.events if type(e) is WriteBack and frozen_copy(e))
        full_h2d, full_d2h = a.bytes_moved()
        assert b.bytes_moved() == (full_h2d - h2d, full_d2h - d2h), (name, spec, update)
        assert h2d + d2h > 0 or name == "resident", (name, spec)
