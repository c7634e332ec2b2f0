"""Split updates (RankPlan.split_update) on R replicas of rings of N > 1 ranks (threads of this
process, shared memory, NumPy backend): rank k of every replica holds the same blocks, and those
R ranks reduce-scatter each of their layers' and head's last-round gradient, update their own
part (AdamW state for it alone) and gather the updated parts; the exact partial squared norms of
every ring rank's split blocks reach every process, so the clip norm keeps its bits. Losses,
gradient norms (clipping active) and final weights must equal the same replicas unsplit, bit for
bit over 3 steps: streamed and resident layers, the vocabulary-parallel head, overlapped rounds,
the sanitizing backend; and through the launcher (processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
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
from dataflow.models.serial import to_json
from dataflow.optimizer import AdamWConfig
from dataflow.ring.job import RingJob
from dataflow.ring.launch import launch
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
        tr = SharedMemoryTransport(k, n, run_id, replica=q, replicas=r, timeout_s=120)
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


def test_launched_split_rings_equal_unsplit_rings(tmp_path, rng):
    """The launcher's path (RingJob.split_update, 2 replicas x ring of 2: four processes,
    --transport shm): every process's losses and every block's final weights are the same job's
    without the flag, bit for bit, clipping on."""
    def run(split: bool, out: Path):
        cfg = dataclasses.replace(load_config("tiny"), name="tiny2r", n_layers=2)
        job = RingJob(gpus=4, model=to_json(cfg), seqlen=64, host_gb=0.25, dev_gb=0.25,
                      steps=2, seed=seed, data=f"random:{seed}", lr=1e-2, max_grad_norm=0.05,
                      timeout_s=60, out_dir=str(out), grad_accum=GradAccum.FP32, replicas=2,
                      split_update=split,
                      constraints=(("chunk_tokens", 64), ("chunks_per_round", 2),
                                   ("rounds_per_step", 1)))
        res = launch(job)
        assert res.exit_codes == (0,) * 4, res
        info = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert all(i["split_update"] is split for i in info)
        weights = {}
        for r in range(4):
            with np.load(out / f"rank{r}.npz") as z:
                weights.update({(r, k): z[k].view(ml_dtypes.bfloat16).view(np.uint16)
                                for k in z.files})
        return [i["losses"] for i in info], weights

    seed = int(rng.integers(0, 2**31))
    (a_losses, a_w), (b_losses, b_w) = run(False, tmp_path / "a"), run(True, tmp_path / "b")
    assert a_losses == b_losses and all(row == a_losses[0] for row in a_losses)
    assert sorted(a_w) == sorted(b_w) and len({k for _, k in a_w}) >= 4
    for key in a_w:
        assert np.array_equal(a_w[key], b_w[key]), key
