"""Split updates (RankPlan.split_update) on R replicas of rings of N > 1 ranks (threads of this
process, shared memory, NumPy backend): rank k of every replica holds the same blocks, and those
R ranks reduce-scatter each of their layers' and head's last-round gradient, update their own
part (AdamW state for it alone) and gather the updated parts; the exact partial squared norms of
every ring rank's split blocks reach every process, so the clip norm keeps its bits. Losses,
gradient norms (clipping active) and final weights must equal the same replicas unsplit, bit for
bit over 3 steps: streamed and resident layers, the vocabulary-parallel head, overlapped rounds,
the sanitizing backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.backends import make_backend
from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget, GradAccum
from dataflow.memplan.plan.split import SUB_BLOCK
from dataflow.memplan.search.ring_overlap import overlap_rank_plans
from dataflow.memplan.search.ring_plan import make_rank_plans
from dataflow.memplan.step.ring_compile import AllReduce, ReduceScatter, compile_ring_schedule
from dataflow.models.config import load_config
from dataflow.optimizer import AdamWConfig
from dataflow.ring.rank import RingRank
from dataflow.ring.shm import SharedMemoryTransport
from tests.ring.threads import in_threads


def _plans(n_ranks: int, replicas: int, n_layers: int, *, streamed: bool, vocab: bool,
           overlap: int):
    cfg = dataclasses.replace(load_config("tiny"), name=f"tiny{n_layers}", n_layers=n_layers)
    kw = dict(replicas=replicas, grad_accum=GradAccum.FP32, vocab_parallel=vocab,
              chunk_tokens=64, chunks_per_round=2, rounds_per_step=2,
              **({"max_resident_layers": 0} if streamed else {}))
    args = (cfg, 64, Budget.from_gib(0.25, 0.25), get_profile("cpu"), n_ranks)
    rps = overlap_rank_plans(*args, overlap, **kw) if overlap else make_rank_plans(*args, **kw)
    return cfg, rps


def _train(rps, data, seed: int, *, split: bool, sanitize: bool):
    n, r = rps[0].n_ranks, rps[0].replicas

    def process(i, run_id):
        q, k = divmod(i, n)  # replica-major, as the launcher numbers processes
        rp = dataclasses.replace(rps[k], split_update=split)
        tr = SharedMemoryTransport(k, n, run_id, replica=q, replicas=r, timeout_s=30)
        be = make_backend("numpy", sanitize=True, seed=seed + i) if sanitize else \
            make_backend("numpy")
        rank = RingRank(rp, be, tr, seed=seed, deferred_update=True,
                        optimizer=AdamWConfig(lr=1e-2, max_grad_norm=0.05))
        try:
            stats = [rank.train_step(b) for b in data]
            state = {(b.key.region, part): (b.home(part) if b.home(part) is not None
                                            else b.device(part)).size
                     for b in rank.ex.layers + (rank.ex.head,) * rp.holds_head_block
                     for part in ("m", "v")}
            return ([s.loss for s in stats], [s.grad_norm for s in stats], rank.weights(),
                    state)
        finally:
            rank.close()
    return in_threads(process, n * r)


@pytest.mark.parametrize("n_ranks,replicas,n_layers,streamed,vocab,overlap,sanitize", [
    (2, 2, 4, False, False, 0, False),  # 2 x ring of 2, resident
    (2, 2, 4, False, True, 2, True),  # the vocabulary-parallel head, overlapped rounds
    (3, 2, 3, True, False, 0, True),  # 2 x ring of 3, streamed layers and head
    (2, 3, 2, True, True, 0, False),  # 3 x ring of 2, streamed, the vocabulary head
])
def test_split_rings_equal_unsplit_rings_bit_for_bit(rng, n_ranks, replicas, n_layers,
                                                     streamed, vocab, overlap, sanitize):
    """R split replicas of a ring of N: every process's losses, gradient norms (clipping
    active) and final weights are the unsplit replicas' bit for bit over 3 steps, each rank's
    split blocks' m / v at most ceil(S / R) sub-blocks, and every rank reduce-scatters its
    layers (and head) and all-reduces only the embedding."""
    cfg, rps = _plans(n_ranks, replicas, n_layers, streamed=streamed, vocab=vocab,
                      overlap=overlap)
    assert all(rp.round_overlap == overlap and rp.vocab_parallel == vocab for rp in rps)
    for rp in rps:
        events = compile_ring_schedule(dataclasses.replace(rp, split_update=True)).events
        scattered = {e.name for e in events if type(e) is ReduceScatter}
        assert scattered == {f"reducescatter.L{g}" for g in rp.layers} | (
            {"reducescatter.head"} if rp.holds_head_block else set())
        assert [e.name for e in events if type(e) is AllReduce] == (["allreduce.embed"] if
                                                                    rp.has_embed else [])
    seed = int(rng.integers(0, 2**30))
    rows = rps[0].plan.chunking.seqs_per_step * replicas
    data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(3)]
    want = _train(rps, data, seed, split=False, sanitize=sanitize)
    got = _train(rps, data, seed, split=True, sanitize=sanitize)
    for i in range(n_ranks * replicas):
        (wl, wn, ww, w_state), (gl, gn, gw, g_state) = want[i], got[i]
        assert gl == wl and gn == wn, (i, gl, wl, gn, wn)
        assert min(gn) > 0.05  # clipping was on and active
        assert sorted(gw) == sorted(ww) and sorted(g_state) == sorted(w_state)
        for key, size in g_state.items():
            assert size <= -(-w_state[key] // (SUB_BLOCK * replicas)) * SUB_BLOCK < \
                w_state[key], (i, key)
        for key in ww:
            assert np.array_equal(np.asarray(gw[key]).view(np.uint16),
                                  np.asarray(ww[key]).view(np.uint16)), (i, key)
