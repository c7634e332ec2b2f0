"""Mixture-of-experts models as data-parallel replicas (rings of 1): every replica holds every
layer, experts included, so each runs the single-device round (per-round routing totals and
auxiliary losses, as one device's rounds) and the replicas sum their gradients. Two replicas
against one device running both replicas' rows as two rounds: fp32 accumulation and one chunk a
round keep the single-device order of every sum, so losses, auxiliary losses and weights must be
bit-identical, with each replica fetching all of every streamed layer or half of it (split
fetches). Rings of two and more ranks pass the round's routing totals between their ranks
(dataflow.memplan.step.ring_compile) and train it as one device, within fp32 rounding of the sums."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget, GradAccum, OptimizerWhere
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
    from dataflow.memplan.plan.ranks import RankPlan
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
        tr = SharedMemoryTransport(0, 1, run_id, replica=q, replicas=2, timeout_s=120)
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


CHUNKING = (("chunk_tokens", 2 * SEQLEN), ("chunks_per_round", 2), ("rounds_per_step", 2))
"""Two sequences a chunk, two chunks a round, two rounds a step."""


@pytest.mark.parametrize("n_layers,placement", [(2, "cyclic"), (4, "cyclic"), (4, "contiguous")])
def test_a_ring_of_two_trains_moe_as_one_device(rng, n_layers, placement):
    """A ring of 2 (threads, shared memory) of an MoE model: each rank adds its layers' routing
    to the round's totals, the ranks pass them along their last layers to the head and back
    before the backward, so every layer's load-balancing gradient sees the whole round's.
    Against one device with the same chunking: counts are exact, the fp32 sums are added in
    another order (each rank's partial, then the next's), so the losses agree within fp32
    rounding in step 1 (the same weights) and within docs/ring.md's bf16 bound after it, the
    auxiliary losses likewise; every block's weights moved."""
    from dataflow.ring.engine import Ring, RingEngine
    from dataflow.ring.env import RankEnv

    cfg = dataclasses.replace(CFG, name=f"olmoe-tiny{n_layers}", n_layers=n_layers)
    seed = int(rng.integers(0, 2**31))
    common = dict(host_gb=1, dev_gb=0.5, seqlen=SEQLEN, backend="numpy", seed=seed, lr=1e-2,
                  plan_options=dict(CHUNKING))
    with Engine(cfg, **common) as eng:
        rows = eng.seqs_per_step
        data = [rng.integers(0, cfg.vocab_size, (rows, SEQLEN + 1), dtype=np.int32)
                for _ in range(3)]
        want = [eng.train_step(b) for b in data]
    assert all(r.aux_loss is not None and r.aux_loss > 0 for r in want)

    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=2, local_rank=r, master_addr="127.0.0.1",
                      master_port=0, run_id=run_id)
        with Engine(cfg, ring=Ring(env=env, replicas=1, placement=placement, timeout_s=30),
                    **common) as eng:
            assert isinstance(eng, RingEngine) and eng.rank_plan.n_ranks == 2
            return [eng.train_step(b) for b in data]

    for got in in_threads(rank, 2):
        assert got[0].loss == pytest.approx(want[0].loss, rel=1e-6)
        assert got[0].aux_loss == pytest.approx(want[0].aux_loss, rel=1e-6)
        assert np.allclose([s.loss for s in got], [r.loss for r in want], rtol=1e-4, atol=0)
        assert np.allclose([s.aux_loss for s in got], [r.aux_loss for r in want], rtol=1e-4,
                           atol=0)
    assert want[2].loss != want[0].loss  # the weights moved


def test_a_placement_whose_last_layers_skip_around_the_ring_is_refused_for_moe():
    """The routing totals follow the ranks' last layers, each to its next neighbour: a ring of 3
    whose last layers are not in ring order cannot pass them and says so."""
    from dataflow.memplan.plan.ranks import moe_routing_chain, routing_chain

    assert routing_chain(4, 2) == (0, 1)  # cyclic: layers 2, 3 last
    assert routing_chain(5, 2) == (1, 0)  # cyclic, the head on rank 0
    assert routing_chain(4, 2, (0, 0, 1, 1)) == (0, 1)  # contiguous
    assert routing_chain(6, 3, (0, 1, 2, 0, 2, 1)) is None  # last layers 3, 4, 5 on 0, 2, 1
    with pytest.raises(ConfigError, match="balanced placement over 3 ranks.*cyclic or contiguous"):
        moe_routing_chain("m", 6, 3, (0, 1, 2, 0, 2, 1), "balanced")
