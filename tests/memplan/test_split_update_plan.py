"""The planner's split updates (dataflow-plan --split-update, choose_layout(split_update=True)):
replicas of rings of any size are weighed with their update split, each rank predicted from its
compiled split schedule, the reduce-scatter timed as half an all-reduce, and the host bytes a
replica's rank holds fall with R; what is not built is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.cli.plan import main as plan_main
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.plan.split import SUB_BLOCK, part_bounds, split_memory_map
from dataflow.memplan.search.layout import allreduce_seconds, choose_layout
from dataflow.memplan.search.ring_plan import LINKS
from dataflow.memplan.step.events import Ref
from dataflow.memplan.step.ring_compile import AllReduce, ReduceScatter
from dataflow.memplan.step.ring_sim import RingComm
from dataflow.models.config import load_config

H100 = get_profile("h100")
B8 = Budget.from_gib(80, 24)
CAP = 1_048_576


def test_parts_are_balanced_runs_of_whole_sub_blocks():
    """part_bounds: R + 1 offsets from 0 to n, on sub-block boundaries but the last, the parts'
    sub-block counts within one of each other."""
    for n in (1024, 46336, 218_112_000 // 7, 5 * 1024 + 3):
        for r in range(1, 9):
            b = part_bounds(n, r)
            assert b[0] == 0 and b[-1] == n and len(b) == r + 1
            assert all(x % SUB_BLOCK == 0 for x in b[:-1])
            counts = [-(-(hi - lo) // SUB_BLOCK) for lo, hi in zip(b, b[1:])]
            assert max(counts) - min(counts) <= 1, (n, r, counts)


def test_a_split_replicas_host_bytes_fall_with_the_replicas():
    """8b at 80 / 24: the m / v at home of a split replica shrink by R, so its host bytes fall
    strictly with R (device bytes never grow)."""
    plan = make_plan(load_config("8b"), 8192, B8, H100)
    host = [split_memory_map(plan, r).host_bytes for r in (1, 2, 4, 8)]
    dev = [split_memory_map(plan, r).device_bytes for r in (1, 2, 4, 8)]
    assert host[0] == plan.memory.host_bytes
    assert all(a > b for a, b in zip(host, host[1:])), host
    assert all(a >= b for a, b in zip(dev, dev[1:])), dev


@pytest.mark.parametrize("gpus", [2, 4])
def test_choose_layout_weighs_split_updates_and_counts_them(gpus):
    """Replicas of rings of 1 at the 1M-token batch: with split_update the split layout is
    chosen, predicted faster than the whole update, with fewer host bytes a replica; the rank
    plans handed on say split_update."""
    cfg = load_config("8b")
    whole = choose_layout(cfg, 8192, B8, H100, gpus, tokens_per_step=CAP, ring_size=1,
                          quick=True)
    split = choose_layout(cfg, 8192, B8, H100, gpus, tokens_per_step=CAP, ring_size=1,
                          quick=True, split_update=True)
    assert not whole.chosen.layout.split_update and split.chosen.layout.split_update
    assert split.chosen.on("nvlink").tok_per_s > whole.chosen.on("nvlink").tok_per_s
    assert split.chosen.host_bytes < whole.chosen.host_bytes
    assert all(rp.split_update and rp.replicas == gpus for rp in split.rank_plans)
    assert split.to_json_dict()["layout"]["split_update"] is True
    assert "split_update" not in whole.to_json_dict()["layout"]


def test_split_rings_are_weighed_and_spend_what_the_split_frees():
    """8b at 30 / 24 a GPU (one device does not fit; rings are the only layouts): 4 replicas of a
    ring of 2 with split updates are planned with m / v for their part from the start
    (Plan.state_parts 4) and spend the host bytes that frees on a fuller ring (more chunks a
    round), predicted faster than unsplit and within the budgets; the rank plans say so."""
    cfg, budget = load_config("8b"), Budget.from_gib(30, 24)
    whole = choose_layout(cfg, 8192, budget, H100, 8, tokens_per_step=CAP, ring_size=2,
                          quick=True)
    split = choose_layout(cfg, 8192, budget, H100, 8, tokens_per_step=CAP, ring_size=2,
                          quick=True, split_update=True)
    assert whole.single_tok_per_s is None
    assert split.chosen.layout.split_update and split.chosen.layout.ring_size == 2
    assert split.chosen.on("nvlink").tok_per_s > whole.chosen.on("nvlink").tok_per_s
    assert split.chosen.chunks_per_round > whole.chosen.chunks_per_round
    assert split.chosen.host_bytes <= budget.host_bytes
    assert all(rp.split_update and rp.replicas == 4 and rp.n_ranks == 2
               and rp.plan.state_parts == 4 for rp in split.rank_plans)


def test_the_reduce_scatter_is_timed_as_half_an_all_reduce():
    """RingComm: a ReduceScatter of B bytes over R takes (R - 1) / R * B / rate, half of an
    AllReduce's; the layout's per-step reduce of a split replica is below the whole one's."""
    comm = RingComm(rank=0, replicas=4, bytes_per_s=1e9, latency_s=0.0, arrivals=None)
    ref = Ref("grads", 0, 1 << 30)
    ar = comm.finish(AllReduce("a", ref, "bf16"), 0.0)
    rs = comm.finish(ReduceScatter("r", ref, "bf16", 4, part_bounds(1 << 29, 4)), 0.0)
    assert rs == pytest.approx(ar / 2) and rs == pytest.approx(0.75 * (1 << 30) / 1e9)
    plan = make_plan(load_config("8b"), 8192, B8, H100)
    rp = RankPlan(rank=0, n_ranks=1, layers=tuple(range(32)), has_embed=True, has_head=True,
                  n_layers=32, plan=plan, replicas=4)
    split = dataclasses.replace(rp, split_update=True)
    assert allreduce_seconds(split, 4, LINKS[0]) < allreduce_seconds(rp, 4, LINKS[0])


def test_dataflow_plan_split_update_flag(capsys):
    """--help names --split-update; with one GPU it is refused by name (exit 2)."""
    assert plan_main(["--help"]) == 0
    assert "--split-update" in capsys.readouterr().out
    assert plan_main(["80", "24", "8192", "8b", "--split-update"]) == 2
    err = capsys.readouterr().err
    assert "--split-update" in err and "--gpus 2" in err


def test_split_updates_of_an_moe_model_are_refused_by_name():
    """An MoE model's replicas are weighed whole; the split is named among the refusals."""
    c = choose_layout(load_config("olmoe-1b-7b"), 4096, Budget.from_gib(120, 24), H100, 2,
                      ring_size=1, quick=True, split_update=True)
    assert not c.chosen.layout.split_update
    assert any("split-update" in r and "MoE" in r for r in c.refused), c.refused
