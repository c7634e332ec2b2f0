"""The layout's charge for the replicas' gradient reduce is what the compiled step does: every
layer's and the head's reduce runs on a finished sum in device memory (a home-kept gradient's
slot fetched the earlier rounds' sums: those copies are the schedule's own), so it costs at most
the wire time (allreduce_seconds), and a ring of one's final figure is the time the schedule's
reduces add timed in place (reduce_exposure_seconds: RingComm reduce=True against False)."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget, Where
from dataflow.memplan.search.layout import allreduce_seconds
from dataflow.memplan.search.predict import predict_schedule, reduce_exposure_seconds
from dataflow.memplan.search.ring_plan import LINKS, make_rank_plans, ring_profile
from dataflow.memplan.step.ring_compile import AllReduce, ReplicaCompiler
from dataflow.memplan.step.ring_sim import RingComm
from dataflow.memplan.step.ring_split import GATHER, REDUCE, ReduceScatter
from dataflow.models.config import load_config

R = 4
"""Replicas."""


@pytest.fixture(scope="module", params=[False, True], ids=["whole", "split"])
def replica(request):
    """1b at 8k in 40 / 10 on the h100 profile as one of 4 replicas, two rounds a step: its
    layers' gradients kept at home, summed in device slots round by round."""
    prof = ring_profile(get_profile("h100"), R, "nccl", R)
    split = request.param
    rp = make_rank_plans(load_config("1b"), 8192, Budget.from_gib(40, 10), prof, 1, replicas=R,
                         tokens_per_step=2 * 8192, chunks_per_round=1, state_parts=R if split else 1)[0]
    return dataclasses.replace(rp, split_update=split)


def test_every_layer_and_head_reduce_is_on_device_memory(replica):
    plan = replica.plan
    assert any(lp.grads is Where.HOME for lp in plan.layers)
    sch = ReplicaCompiler(replica).compile(plan.chunking.rounds_per_step, "deferred")
    places = {r.name: r.place for r in (*sch.regions.device, *sch.regions.host)}
    reduces = [e for e in sch.events if type(e) in (AllReduce, ReduceScatter)]
    assert len(reduces) == len(plan.layers) + 2  # every layer, the head, the embedding
    for e in reduces:
        if e.name != "allreduce.embed" or plan.embed.grads is not Where.HOME:
            assert places[e.dst.region] == "device", e.name


def test_the_reduces_add_at_most_their_wire_time_to_the_compiled_step(replica):
    """Timed in place the reduces add no more than allreduce_seconds' wire time (this replica
    streams most of its layers, and its copy waits hide part of it: 8b at 80 / 24 as 64 split
    replicas hides none); the charge of a ring of one is that time, not the wire time plus a
    second staging of the home-kept sums."""
    link = LINKS[0]
    assert replica.plan.chunking.rounds_per_step == 2

    def step(reduce: bool) -> float:
        comm = RingComm(rank=0, replicas=R, bytes_per_s=link.bytes_per_s,
                        latency_s=link.latency_s, arrivals=None, streams=(REDUCE, GATHER),
                        reduce=reduce)
        return predict_schedule(replica.plan, replica.plan.profile, comm=comm,
                                compiler=lambda n, u: ReplicaCompiler(replica).compile(n, u)
                                ).step_time_s

    added = step(True) - step(False)
    assert reduce_exposure_seconds(replica, link.bytes_per_s, link.latency_s) == \
        pytest.approx(added, rel=1e-12)
    wire = allreduce_seconds(replica, R, link)
    assert 0 < added <= wire * (1 + 1e-9)
