"""Split updates (RankPlan.split_update): R = 2, 3, 4 replicas of a ring of 1 (plain data
parallelism, threads of this process, shared memory, NumPy backend) reduce-scatter each layer's
and the head's last-round gradient, update only their own part (a run of whole 1,024-element
sub-blocks, AdamW state for that part alone) and gather the parts of the updated weights.
Their losses, gradient norms (clipping on) and final weights must equal the unsplit replicas'
bit for bit, with streamed and with resident layers; what is not built is refused by name.
Replicas of rings of 2+: tests/ring/test_split_update_rings.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dataflow.backends import make_backend
from dataflow.memplan.plan.plan import GradAccum, OptimizerWhere
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.plan.split import SUB_BLOCK, part_range, split_memory_map
from dataflow.memplan.step.compile import Update, WriteBack
from dataflow.memplan.step.ring_compile import (AllReduce, GatherParts, ReduceScatter,
                                                compile_ring_schedule)
from dataflow.models.config import load_config
from dataflow.models.layout import BlockKind, head_layout, layer_layout
from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json
from dataflow.optimizer import AdamWConfig
from dataflow.ring.checkpoint import load_ring_checkpoint, save_ring_checkpoint
from dataflow.ring.job import RingJob
from dataflow.ring.launch import launch
from dataflow.ring.rank import RingRank
from dataflow.ring.shm import SharedMemoryTransport
from dataflow.ring.transport import Transport
from tests.dataflow.plans import RESIDENT, forced_plan, streamed
from tests.ring.threads import in_threads

CFG = load_config("tiny")
HOST, STRM = streamed(OptimizerWhere.HOST), streamed(OptimizerWhere.STREAMED)
PLACEMENTS = {
    "streamed": dict(layers=(HOST, STRM), embed=HOST, head=STRM),
    "resident": dict(layers=(RESIDENT, RESIDENT), embed=RESIDENT, head=RESIDENT),
}


def _rank_plan(where: str, *, split: bool, split_fetch: bool = False,
               replicas: int = 2, grad_accum: GradAccum = GradAccum.FP32) -> RankPlan:
    plan = forced_plan(CFG, 64, chunk_tokens=128, seqs_per_chunk=2, rounds=2,
                       head_sub_tokens=128, grad_accum=grad_accum, **PLACEMENTS[where])
    return RankPlan(rank=0, n_ranks=1, layers=(0, 1), has_embed=True, has_head=True,
                    n_layers=2, plan=plan, replicas=replicas, split_fetch=split_fetch,
                    split_update=split)


def _train(rp: RankPlan, data, seed: int, deferred: bool):
    r = rp.replicas

    def replica(q, run_id):
        # 120 s: a replica still warming up (a cold numba cache on a loaded 2-core CI machine)
        # must not look hung to the peers waiting at the first gather
        tr = SharedMemoryTransport(0, 1, run_id, replica=q, replicas=r, timeout_s=120)
        rank = RingRank(rp, make_backend("numpy"), tr, seed=seed, deferred_update=deferred,
                        optimizer=AdamWConfig(lr=1e-2, max_grad_norm=0.05))
        try:
            stats = [rank.train_step(b) for b in data]
            state = {}
            for b in rank.ex.layers + (rank.ex.head,):  # the AdamW state this replica holds
                for part in ("m", "v"):
                    view = b.home(part) if b.home(part) is not None else b.device(part)
                    if view is not None:
                        state[(b.key.region, part)] = view.size
            if rp.split_update:  # a part's m / v cannot be read as the block's
                with pytest.raises(ConfigError, match="part only"):
                    rank.read_block(next(r for r in rank.block_refs()
                                         if r.kind is not BlockKind.EMBED), "m")
            return ([s.loss for s in stats], [s.grad_norm for s in stats], rank.weights(),
                    state)
        finally:
            rank.close()
    return in_threads(replica, r)


BF16 = GradAccum.BF16


@pytest.mark.parametrize("where,deferred,split_fetch,replicas,accum", [
    ("streamed", True, False, 2, None), ("streamed", False, True, 2, None),
    ("resident", True, False, 2, None), ("streamed", True, False, 3, None),
    ("resident", False, False, 3, BF16), ("streamed", True, True, 4, None),
    ("streamed", False, False, 4, BF16)])
def test_split_replicas_equal_unsplit_replicas_bit_for_bit(rng, where, deferred, split_fetch,
                                                           replicas, accum):
    """R split replicas: the unsplit replicas' losses, gradient norms (clipping active) and
    final weights bit for bit over 3 steps, each holding m / v for its part alone (fp32 or
    bf16 gradient sums)."""
    seed = int(rng.integers(0, 2**31))
    rows = 4 * replicas  # two sequences a chunk, two rounds, on each replica
    data = [rng.integers(0, CFG.vocab_size, (rows, 65), dtype=np.int32) for _ in range(3)]
    kw = dict(replicas=replicas, grad_accum=accum or GradAccum.FP32)
    want = _train(_rank_plan(where, split=False, **kw), data, seed, deferred)
    got = _train(_rank_plan(where, split=True, split_fetch=split_fetch, **kw), data, seed,
                 deferred)
    for q in range(replicas):
        (wl, wn, ww, w_state), (gl, gn, gw, g_state) = want[q], got[q]
        assert gl == wl and gn == wn, (q, gl, wl, gn, wn)
        assert sorted(g_state) == sorted(w_state)
        for key, n in g_state.items():  # the part's state only: at most ceil(S / R) sub-blocks
            assert n <= -(-w_state[key] // (SUB_BLOCK * replicas)) * SUB_BLOCK < w_state[key]
        assert min(gn) > 0.05  # clipping was on and active
        for key in ww:
            assert np.array_equal(np.asarray(gw[key]).view(np.uint16),
                                  np.asarray(ww[key]).view(np.uint16)), (q, key)


@pytest.mark.parametrize("where,replicas", [("streamed", 3), ("resident", 2)])
def test_replicas_of_a_plan_parted_from_the_start_equal_unsplit_replicas(rng, where, replicas):
    """The same decisions planned with m / v for one part (Plan.state_parts, as the planner's
    split layouts are): the split replicas train the unsplit replicas' bits over 3 steps
    (their tables are the parted plan's memory map: tests/memplan/test_split_update_memory)."""
    seed = int(rng.integers(0, 2**31))
    data = [rng.integers(0, CFG.vocab_size, (4 * replicas, 65), dtype=np.int32)
            for _ in range(3)]
    whole = _rank_plan(where, split=False, replicas=replicas)
    parted = dataclasses.replace(whole.plan, state_parts=replicas,
                                 memory=split_memory_map(whole.plan, replicas))
    want = _train(whole, data, seed, True)
    got = _train(dataclasses.replace(whole, plan=parted, split_update=True), data, seed, True)
    for q in range(replicas):
        assert got[q][:2] == want[q][:2], q
        for key in want[q][2]:
            assert np.array_equal(np.asarray(got[q][2][key]).view(np.uint16),
                                  np.asarray(want[q][2][key]).view(np.uint16)), (q, key)


@pytest.mark.parametrize("where,replicas", [("streamed", 2), ("resident", 3), ("streamed", 4)])
def test_split_schedule_reduce_scatters_and_updates_its_part(where, replicas):
    """Each replica's schedule reduce-scatters the layers and the head, all-reduces the
    embedding, updates exactly its part (part_range: whole sub-blocks) and gathers the updated
    weights; the last round writes only its part of a streamed gradient home."""
    rp = _rank_plan(where, split=True, replicas=replicas)
    for q in range(replicas):
        events = compile_ring_schedule(rp, replica=q).events
        scattered = sorted(e.name for e in events if type(e) is ReduceScatter)
        assert scattered == ["reducescatter.L0", "reducescatter.L1", "reducescatter.head"]
        assert [e.name for e in events if type(e) is AllReduce] == ["allreduce.embed"]
        updates = [e for e in events if type(e) is Update and "embed" not in e.block]
        numel = {}
        for e in updates:  # every piece inside this replica's part
            numel.setdefault(e.block, []).append((e.start, e.count))
        for block, pieces in numel.items():
            lo = min(s for s, _ in pieces)
            hi = max(s + n for s, n in pieces)
            whole = (head_layout(CFG) if block == "head" else layer_layout(CFG)).numel
            assert (lo, hi) == part_range(whole, replicas, q), (block, q, pieces)
            assert lo % SUB_BLOCK == 0
        gathered = [e for e in events if type(e) is GatherParts and e.name.startswith("gather.")]
        assert len(gathered) == 3 and all(len(e.bounds) == replicas + 1 for e in gathered)
        grads_home = [e for e in events if type(e) is WriteBack
                      and e.name.startswith(("g.d2h", "headg.d2h"))]
        if where == "streamed":  # round 0 writes the whole sums home, the last round its part
            half = len(grads_home) // 2
            for first, last in zip(grads_home[:half], grads_home[half:]):
                lo, hi = part_range(first.dst.nbytes // 4, replicas, q)  # fp32 gradients
                assert (last.dst.offset, last.dst.nbytes) == (first.dst.offset + lo * 4,
                                                              (hi - lo) * 4)
                assert (last.src.offset, last.src.nbytes) == (first.src.offset + lo * 4,
                                                              (hi - lo) * 4)
    plain = compile_ring_schedule(dataclasses.replace(rp, split_update=False)).events
    assert not any(type(e) is ReduceScatter for e in plain)


def test_split_update_refuses_what_is_not_built():
    """More replicas than a block has sub-blocks are refused by name (rings of 2+, overlapped
    rounds and the vocabulary-parallel head run: tests/ring/test_split_update_rings.py)."""
    rp = _rank_plan("streamed", split=True)
    with pytest.raises(ConfigError, match="fewer than the 64 replicas"):
        compile_ring_schedule(dataclasses.replace(rp, replicas=64))


def test_launched_split_replicas_equal_unsplit_replicas(tmp_path, rng):
    """The launcher's path (RingJob.split_update, two processes, --transport shm): the same
    losses and final weights as the same job without the flag, bit for bit, clipping on."""
    def run(split: bool, out: Path):
        job = RingJob(gpus=2, model=to_json(dataclasses.replace(CFG, name="tiny2s", n_layers=2)),
                      seqlen=64, host_gb=0.25, dev_gb=0.25, steps=2, seed=seed,
                      data=f"random:{seed}", lr=1e-2, max_grad_norm=0.05, timeout_s=60,
                      out_dir=str(out), grad_accum=GradAccum.FP32, replicas=2,
                      split_update=split,
                      constraints=(("chunk_tokens", 64), ("chunks_per_round", 1),
                                   ("rounds_per_step", 1)))
        res = launch(job)
        assert res.exit_codes == (0, 0), res
        info = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert all(i["split_update"] is split for i in info)
        losses = [i["losses"] for i in info]
        with np.load(out / "rank0.npz") as z:
            weights = {k: z[k].view(ml_dtypes.bfloat16).view(np.uint16) for k in z.files}
        return losses, weights

    seed = int(rng.integers(0, 2**31))
    (a_losses, a_w), (b_losses, b_w) = run(False, tmp_path / "a"), run(True, tmp_path / "b")
    assert a_losses == b_losses and a_losses[0] == a_losses[1]
    assert sorted(a_w) == sorted(b_w)
    for key in a_w:
        assert np.array_equal(a_w[key], b_w[key]), key


def test_checkpoints_and_other_transports_are_refused_by_name(tmp_path):
    """A split replica holds AdamW state for its half alone: saving and resuming are refused
    before anything is written or read; a transport without a reduce-scatter names the flag."""
    class Stand:  # the checkpoint reads the rank plan first
        rp = _rank_plan("resident", split=True)

    with pytest.raises(ConfigError, match="--split-update"):
        save_ring_checkpoint(Stand(), None, CFG, tmp_path)
    with pytest.raises(ConfigError, match="--split-update"):
        load_ring_checkpoint(Stand(), None, CFG, tmp_path)
    with pytest.raises(ConfigError, match="run on the shared-memory and NCCL transports"):
        Transport.reduce_scatter(Stand(), None, ())
