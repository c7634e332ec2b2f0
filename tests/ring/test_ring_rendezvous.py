"""A ring's schedules checked against a rendezvous transport (memplan/step/ring_rendezvous.py:
NCCL's point-to-point sends complete only once their receive is posted, and each link's
messages are taken in the order sent). The plain ring (run over NCCL on two H200s) and the
vocabulary-parallel head pass for rings of 2, 3 and 4; overlapped rounds, which the NCCL
transport refuses, fail it: out of order on a ring of 2, a cycle of waits on rings of 3 and 4,
though they run over shared memory, where sends never wait (rendezvous=False passes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dataflow.memplan.search.ring_overlap import overlap_rank_plans
from dataflow.memplan.search.ring_plan import make_rank_plans
from dataflow.memplan.step.compile import Ref
from dataflow.memplan.step.ring_compile import Recv, Send, compile_ring_schedule
from dataflow.memplan.step.ring_rendezvous import check_rendezvous, refuse_rendezvous_deadlock
from dataflow.models.errors import ConfigError
from tests.ring.small_rings import BUDGET, CHUNKING, CPU, sends_pair_with_receives, tiny_with


def _schedules(plans, update: str):
    return [compile_ring_schedule(rp, update=update) for rp in plans]


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
@pytest.mark.parametrize("vocab", [False, True], ids=["one-head", "vocab-head"])
def test_plain_and_vocabulary_parallel_rings_cannot_deadlock_on_rendezvous(n_ranks, vocab):
    cfg = tiny_with(8)
    plans = make_rank_plans(cfg, 64, BUDGET, CPU, n_ranks, vocab_parallel=vocab, **CHUNKING)
    for update in ("end", "deferred"):
        report = check_rendezvous(_schedules(plans, update))
        assert report.ok, (report.order, report.cycle[:8])
        assert report.sends == sends_pair_with_receives(plans)
    assert refuse_rendezvous_deadlock(plans) == report.sends


@pytest.mark.parametrize("n_ranks,n_layers,depth,problem",
                         [(2, 4, 1, "order"), (3, 6, 2, "cycle"), (4, 4, 1, "cycle")])
def test_overlapped_rounds_fail_it_and_are_refused_by_name(n_ranks, n_layers, depth, problem):
    plans = overlap_rank_plans(tiny_with(n_layers), 64, BUDGET, CPU, n_ranks, depth, **CHUNKING)
    schedules = _schedules(plans, "deferred")
    report = check_rendezvous(schedules)
    assert not report.ok and bool(getattr(report, problem))
    if problem == "cycle":  # a cycle of waits: a send's end waits for a receive's start, ...
        assert any("(end)" in n and "send." in n for n in report.cycle)
        assert check_rendezvous(schedules, rendezvous=False).ok  # shared memory runs them
    with pytest.raises(ConfigError, match="use --transport shm"):
        refuse_rendezvous_deadlock(plans, what="overlapped rounds")


def test_a_hand_made_deadlock_and_a_mismatched_link_are_found():
    """Two ranks that each send, then receive, on one stream wait for each other; a link whose
    receiver expects another tag is named."""
    ref = Ref("x", 0, 1 << 20)

    def rank(peer: int, tag_in: int):
        return SimpleNamespace(events=[Send("s", ref, peer, 1, stream="comm"),
                                       Recv("r", ref, peer, tag_in, stream="comm")])

    report = check_rendezvous([rank(1, 1), rank(0, 1)])
    assert report.order == "" and len(report.cycle) >= 2
    assert check_rendezvous([rank(1, 1), rank(0, 1)], rendezvous=False).ok
    bad = check_rendezvous([rank(1, 1), rank(0, 2)])
    assert bad.order == ("rank 0 -> rank 1: message 0 is sent as (tag, bytes) (1, 1048576) but "
                         "received as (2, 1048576)")


def test_an_nccl_rank_with_the_vocabulary_head_checks_the_ring_before_any_communicator(
        monkeypatch):
    """open_rank over NCCL with the vocabulary-parallel head plans every rank of its ring and
    checks their schedules before making the transport: the plain order passes (and reaches
    the transport), overlapped rounds are refused by name (and never reach it)."""
    from dataflow.backends import make_backend
    from dataflow.ring import bootstrap
    from dataflow.ring.env import RankEnv
    from dataflow.ring.kinds import TransportKind

    class Reached(Exception):
        pass

    def no_transport(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(bootstrap, "make_rank_backend", lambda *a: make_backend("numpy"))
    monkeypatch.setattr(bootstrap, "make_transport", no_transport)
    env = RankEnv(rank=1, gpus=3, local_rank=1, master_addr="127.0.0.1", master_port=1,
                  run_id="rv")
    common = dict(env=env, transport=TransportKind.NCCL, profile=CPU, vocab_parallel=True,
                  **CHUNKING)
    with pytest.raises(Reached):
        bootstrap.open_rank(tiny_with(6), 64, 0.25, 0.25, **common)
    with pytest.raises(ConfigError, match="the vocabulary-parallel head over NCCL"):
        bootstrap.open_rank(tiny_with(6), 64, 0.25, 0.25, round_overlap=1, **common)


def test_8b_as_a_vocabulary_parallel_ring_of_4_passes_at_its_planned_shape():
    """The shape a 4-GPU machine would run (8b at 8k, 30 / 24 per GPU on the h100 profile, 1M
    tokens a step: 32 rounds): thousands of messages, no cycle, in both update modes."""
    from dataflow.memplan import get_profile
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.search.ring_plan import make_rank_plan, ring_profile
    from dataflow.models.config import load_config

    cfg, prof = load_config("8b"), ring_profile(get_profile("h100"), 4, "nccl", 1)
    plans = [make_rank_plan(cfg, 8192, Budget.from_gib(30, 24), prof, 4, r, vocab_parallel=True,
                            tokens_per_step=1_048_576) for r in range(4)]
    for update in ("end", "deferred"):
        assert refuse_rendezvous_deadlock(plans, update) > 4000
