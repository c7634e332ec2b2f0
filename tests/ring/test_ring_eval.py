"""RingEngine.eval_step on CPU (ranks as threads, NumPy backend, shared-memory transport): the
ring's forward-only evaluation (dataflow.memplan.step.ring_compile.compile_ring_eval_schedule: the forward's
sends and receives, no backward, no optimizer) gives one device's eval_step loss bit for bit,
with replicas too, and leaves the weights, the pending update and the next step untouched."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow.engine import Engine
from dataflow.memplan.search.ring_plan import make_rank_plan
from dataflow.memplan.step.ring_compile import Recv, Send, compile_ring_eval_schedule
from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import load_config
from dataflow.ring.engine import Ring
from dataflow.ring.env import RankEnv
from tests.ring.threads import in_threads

CHUNKING = (("chunk_tokens", 128), ("chunks_per_round", 2), ("rounds_per_step", 2))
"""Two sequences of 64 tokens per chunk, two chunks per round (4 rows), two rounds per step."""
CFG = dataclasses.replace(load_config("tiny"), name="tiny4", n_layers=4)
COMMON = dict(host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", lr=1e-2, seed=11,
              plan_options=dict(CHUNKING))


def _ring(n: int, fn, replicas: int = 1) -> list:
    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=n, local_rank=r, master_addr="127.0.0.1",
                      master_port=0, run_id=run_id)
        with Engine(CFG, ring=Ring(env=env, replicas=replicas, timeout_s=30), **COMMON) as eng:
            return fn(eng)

    return in_threads(rank, n)


def _bits(blocks: dict) -> dict:
    return {k: v.view(np.uint16).copy() for k, v in blocks.items()}


def test_a_ring_evaluates_as_one_device_and_changes_nothing(rng):
    """A ring of 2 evaluates 6 rows (padded to 2 rounds) before and after a step to one
    device's losses exactly; the evaluation after the step (whose AdamW is still pending) runs
    that update first, changes no weight, and the next step's loss is one device's."""
    train = [rng.integers(0, CFG.vocab_size, (8, 65), dtype=np.int32) for _ in range(2)]
    held = rng.integers(0, CFG.vocab_size, (6, 65), dtype=np.int32)
    labels = held.copy()  # the shape of the tokens (labels[:, 0] is never a target)
    labels[0, :10] = -100  # ignored targets count nothing, as on one device
    with Engine(CFG, **COMMON) as eng:
        want = [eng.eval_step(held, labels)]
        want.append(eng.train_step(train[0]).loss)
        want.append(eng.eval_step(held, labels))
        want.append(eng.train_step(train[1]).loss)

    def fn(eng):
        got = [eng.eval_step(held, labels), eng.train_step(train[0]).loss]
        assert eng.rank.ex.update_pending
        got.append(eng.eval_step(held, labels))
        before = _bits(eng.weights())
        assert eng.eval_step(held, labels) == got[-1]
        after = _bits(eng.weights())
        assert all(np.array_equal(before[k], after[k]) for k in before)
        got.append(eng.train_step(train[1]).loss)
        return got

    assert _ring(2, fn) == [want, want]


def test_replicas_evaluate_their_share_to_one_devices_loss(rng):
    """2 replicas of a ring of 2 evaluate 8 rows, one round each, to one device's loss over
    its two rounds of the same rows."""
    held = rng.integers(0, CFG.vocab_size, (8, 65), dtype=np.int32)
    with Engine(CFG, **COMMON) as eng:
        want = eng.eval_step(held)
    assert _ring(4, lambda eng: eng.eval_step(held), replicas=2) == [want] * 4


def test_each_ranks_evaluation_receives_what_its_neighbour_sends():
    """In the evaluation schedules of a ring of 3 (4 layers), each Send has the matching Recv on
    the next rank (same tag) and no backward message exists."""
    cfg = CFG
    plans = [make_rank_plan(cfg, 64, Budget.from_gib(0.25, 0.25), get_profile("cpu"), 3, r,
                            **dict(CHUNKING)) for r in range(3)]
    scheds = [compile_ring_eval_schedule(rp, 2) for rp in plans]
    sends = {(r, ev.peer, ev.tag) for r, s in enumerate(scheds) for ev in s.events
             if isinstance(ev, Send)}
    recvs = {(ev.peer, r, ev.tag) for r, s in enumerate(scheds) for ev in s.events
             if isinstance(ev, Recv)}
    assert sends and sends == recvs
    assert not [ev for s in scheds for ev in s.events
                if isinstance(ev, (Send, Recv)) and ".b." in ev.name]
    # layers 0..3 on ranks 0, 1, 2, 0: 3 hops a chunk, 2 chunks a round, 2 rounds
    assert len(sends) == 3 * 2 * 2


def test_dataflow_ring_processes_evaluate_after_training_as_one_device(tmp_path):
    """A launched ring of 2 (RingJob.eval_seqs = 3) trains 2 steps and writes the loss of the 3
    sequences after its batches; one device training the same batches evaluates them to the
    same loss."""
    import json

    from dataflow.models.serial import to_json
    from dataflow.ring.launch import launch
    from dataflow.ring.job import RingJob, batches, eval_batch

    job = RingJob(gpus=2, model=to_json(CFG), seqlen=64, host_gb=0.25, dev_gb=0.25, steps=2,
                  seed=11,
                  data="random:5", lr=1e-2, timeout_s=60, out_dir=str(tmp_path), eval_seqs=3,
                  constraints=CHUNKING)
    res = launch(job)
    assert res.exit_codes == (0, 0), res
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    with Engine(CFG, **COMMON) as eng:  # the job's seed, lr, budgets and chunking
        losses = [eng.train_step(b).loss for b in batches(job, CFG, eng.seqs_per_step)]
        want = eng.eval_step(eval_batch(job, CFG, eng.seqs_per_step))
    assert [g["losses"] for g in got] == [losses, losses]
    assert [g["eval_loss"] for g in got] == [want, want]
