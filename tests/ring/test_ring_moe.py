"""Mixture-of-experts models as data-parallel replicas (rings of 1): every replica holds every
layer, experts included, so each runs the single-device round (per-round routing totals and
auxiliary losses, as one device's rounds) and the replicas sum their gradients. Two replicas
against one device running both replicas' rows as two rounds: fp32 accumulation and one chunk a
round keep the single-device order of every sum, so losses, auxiliary losses and weights must be
bit-identical, with each replica fetching all of every streamed layer or half of it (split
fetches). Rings of two or more ranks still refuse MoE by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile
from dataflow.memplan.plan import Budget, GradAccum, OptimizerWhere
from dataflow.models.config import MoE, ModelConfig
from dataflow.models.errors import ConfigError
from tests.dataflow.plans import forced_plan, streamed
from tests.ring.threads import in_threads

CFG = ModelConfig(name="olmoe-tiny", family="olmoe", vocab_size=53, model_dim=32, head_dim=8,
                  n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, rope_theta=1e4, norm_eps=1e-6,
                  qk_norm=True, moe=MoE(n_experts=5, top_k=2, expert_ffn_dim=16,
                                        norm_topk_prob=False, router_aux_loss_coef=0.8))
"""OLMoE's routing (raw top-k weights, whole-projection QK-norm) with an aux coefficient far
above the released one, so the router's share of the gradient shows."""
SEQLEN = 16


def _plan(rounds: int):
    """Both layers streamed with the streamed optimizer, head streamed, embedding at home with
    the host optimizer; one chunk of two sequences a round."""
    strm, host = streamed(OptimizerWhere.STREAMED), streamed(OptimizerWhere.HOST)
    return forced_plan(CFG, SEQLEN, chunk_tokens=2 * SEQLEN, seqs_per_chunk=2, rounds=rounds,
                       layers=(strm, strm), embed=host, head=strm, head_sub_tokens=2 * SEQLEN,
                       grad_accum=GradAccum.FP32)


@pytest.mark.parametrize("split", [False, True])
def test_moe_replicas_reproduce_one_device_bit_for_bit(rng, split):
    from dataflow.backends import make_backend
    from dataflow.memplan.ring_plan import RankPlan
    from dataflow.optimizer import AdamWConfig
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport

    seed, lr = int(rng.integers(0, 2**31)), 1e-2
    data = [rng.integers(0, CFG.vocab_size, (4, SEQLEN + 1), dtype=np.int32) for _ in range(3)]
    with Engine.from_plan(_plan(2), backend="numpy", seed=seed, lr=lr) as eng:
        want = [eng.train_step(b) for b in data]
        w = eng.weights()
    want_w = {"embed": w.embed, "head": w.head, "layer0": w.layers[0], "layer1": w.layers[1]}
    assert all(r.aux_loss is not None and r.aux_loss > 0 for r in want)

    rp = RankPlan(rank=0, n_ranks=1, layers=(0, 1), has_embed=True, has_head=True, n_layers=2,
                  plan=_plan(1), replicas=2, split_fetch=split)

    def replica(q, run_id):
        tr = SharedMemoryTransport(0, 1, run_id, replica=q, replicas=2, timeout_s=30)
        rank = RingRank(rp, make_backend("numpy"), tr, seed=seed, optimizer=AdamWConfig(lr=lr))
        try:
            return [rank.train_step(b) for b in data], rank.weights()
        finally:
            rank.close()

    out = in_threads(replica, 2)
    for q in range(2):
        got, got_w = out[q]
        assert [s.loss for s in got] == [r.loss for r in want], q
        assert [s.aux_loss for s in got] == [r.aux_loss for r in want], q
        for key in want_w:
            assert np.array_equal(got_w[key].view(np.uint16), want_w[key].view(np.uint16)), \
                (q, key)
    assert want[2].loss != want[0].loss  # the weights moved


def test_moe_plans_as_replicas_and_refuses_rings_of_two_or_more():
    """The layout for 2 GPUs of an MoE model weighs data-parallel replicas only, and says why
    a ring of 2 is not possible; a ring rank's executor made by hand refuses too."""
    from dataflow.backends.numpy_backend import NumpyBackend
    from dataflow.memplan.layout import choose_layout
    from dataflow.memplan.ring_plan import RankPlan, make_rank_plans
    from dataflow.ring.executor import RingExecutor

    cpu, budget = get_profile("cpu"), Budget.from_gib(1, 0.5)
    choice = choose_layout(CFG, SEQLEN, budget, cpu, 2, single_tok_per_s=None)
    assert [(o.layout.ring_size, o.layout.replicas) for o in choice.options] == [(1, 2)]
    assert any("rings do not carry MoE layers yet" in r for r in choice.refused), choice.refused
    with pytest.raises(ConfigError, match="rings do not carry MoE layers yet.*issue 41"):
        make_rank_plans(CFG, SEQLEN, budget, cpu, n_ranks=2)
    plan = _plan(1)
    rp = RankPlan(rank=0, n_ranks=2, layers=(0,), has_embed=True, has_head=False, n_layers=2,
                  plan=dataclasses.replace(plan, model=dataclasses.replace(CFG, n_layers=1)))
    with pytest.raises(ConfigError, match="rings do not carry MoE layers yet"):
        RingExecutor(rp, NumpyBackend(), transport=None)
