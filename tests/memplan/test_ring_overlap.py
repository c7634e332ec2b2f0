"""Overlapped rounds (issue 56): the op order each rank runs with the next round's first layers
during a round's drain (dataflow.memplan.step.ring_overlap) keeps every layer's gradient sums in
round order and never deadlocks on random costs; depth 0 is the plain ring the model already
times; the planner's model agrees with the whole step timed op by op on the record's 20 rings;
the planner leaves room for the overlap, carries it in RankPlan / Layout only when on, and the
compiled ring step refuses it by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.bench.ring_overlap_check import RINGS, TOLERANCE, check
from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.layout import choose_layout
from dataflow.memplan.search.ring_overlap import (overlap_rank_plans, overlapped_rounds_s,
                                                  ring_depth, simulate_overlap)
from dataflow.memplan.search.ring_plan import (LINKS, make_rank_plans, predict_ring,
                                               ring_profile, ring_round_s)
from dataflow.memplan.step.ring_compile import compile_ring_schedule
from dataflow.memplan.step.ring_overlap import (BWD, FWD, HEAD, POLICIES, RingCosts,
                                                check_gradient_order, time_overlapped)
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

RECORD = Path(__file__).resolve().parents[2] / "bench" / "records" / "s27-ring-overlap"


def _random_costs(prng, n: int, layers: int, chunks: int, rounds: int, vocab: bool) -> RingCosts:
    owners = tuple(g % n for g in range(layers))
    fwd = tuple(tuple(prng.uniform(0.5, 2.0) for _ in range(chunks)) for _ in range(layers))
    bwd = tuple(tuple(prng.uniform(1.0, 4.0) for _ in range(chunks)) for _ in range(layers))
    head = tuple(prng.uniform(1.0, 5.0) if vocab or r == owners[-1] else 0.0 for r in range(n))
    return RingCosts(owners=owners, chunks=chunks, rounds=rounds, fwd_s=fwd, bwd_s=bwd,
                     head_s=head, head_rank=owners[-1], vocab=vocab,
                     vocab_s=prng.uniform(0, 1) if vocab else 0.0, hop_s=prng.uniform(0, 0.5))


@pytest.mark.parametrize("vocab", [False, True])
def test_overlapped_orders_run_every_op_once_keep_gradient_order_and_never_lose_time(prng, vocab):
    """Random rings (N = 2..5, random op seconds and hops): every rank runs each of its ops
    exactly once, backward ops of a layer in round order (check_gradient_order inside
    time_overlapped, and again here), hoisted forwards only of its first `depth` local layers
    and only of the next round, at any policy; the compute is the plain ring's."""
    for _ in range(6):
        n = prng.randint(2, 5)
        layers = n * prng.randint(1, 3)
        c = _random_costs(prng, n, layers, prng.randint(1, 2 * n), prng.randint(2, 4), vocab)
        plain = time_overlapped(c, 0)
        assert plain.hoisted == 0
        depth = prng.randint(1, layers // n)
        policy = prng.choice(POLICIES)
        t = time_overlapped(c, depth, policy)
        check_gradient_order(t.orders)
        for r, order in enumerate(t.orders):
            mine = [g for g, o in enumerate(c.owners) if o == r]
            want = {(kind, k, g, ch) for kind in (FWD, BWD) for k in range(c.rounds)
                    for g in mine for ch in range(c.chunks)}
            if vocab or r == c.head_rank:
                want |= {(HEAD, k, -1, -1) for k in range(c.rounds)}
            assert len(order) == len(want) and set(order) == want, r
            bwd_done = {k: 0 for k in range(c.rounds)}
            for op in order:  # a forward ahead of the plain order is of the first depth layers
                if op[0] == BWD:
                    bwd_done[op[1]] += 1
                elif op[0] == FWD and op[1] > 0 and \
                        bwd_done[op[1] - 1] < len(mine) * c.chunks:
                    assert op[2] in mine[:depth], (r, op)
        assert abs(sum(t.busy_s) - sum(plain.busy_s)) < 1e-6 * sum(plain.busy_s)


def test_depth_zero_is_the_plain_ring_the_model_times():
    """Without overlap the op-by-op timing of R rounds is R times ring_round_s's critical path
    (what predict_ring has charged all along), for a dense and a vocabulary-parallel ring."""
    cfg, link = load_config("8b"), LINKS[0]
    for vp in (False, True):
        rps = make_rank_plans(cfg, 8192, Budget.from_gib(30, 24),
                              ring_profile(get_profile("h100"), 4, "nccl"), 4,
                              chunks_per_round=4, rounds_per_step=5, vocab_parallel=vp)
        hop = 8192 * cfg.model_dim * 2 / link.bytes_per_s + link.latency_s
        vocab_s = 0.0
        if vp:
            from dataflow.memplan.search.ring_plan import vocab_exchange_s  # the exchange's cost
            vocab_s = vocab_exchange_s(rps[0], link)
        round_s, _ = ring_round_s(rps, hop, vocab_s)
        assert simulate_overlap(rps, hop, 0, vocab_s).step_s == pytest.approx(5 * round_s,
                                                                              rel=1e-9)
        assert overlapped_rounds_s(rps, hop, 8, vocab_s) < 5 * round_s * 0.99


def test_the_record_holds_and_the_model_agrees_with_the_op_timing_on_its_rings():
    """The committed record lists 20 rings within TOLERANCE; a sample of them recomputed today
    agrees with it and stays within TOLERANCE (the whole list: python -m
    dataflow.bench.ring_overlap_check)."""
    record = json.loads((RECORD / "overlap_check.json").read_text())
    rows = record["rings"]
    assert len(rows) == 20 == len(RINGS)
    assert {r["n_ranks"] for r in rows} >= {2, 3, 4, 8}
    assert any(r["vocab"] for r in rows) and not all(r["vocab"] for r in rows)
    assert all(abs(r["error"]) <= TOLERANCE for r in rows)
    assert all(r["gain"] > 0 for r in rows)  # every ring's overlap is faster than in turn
    for i in (0, 9, 12, 17):
        again = check(RINGS[i])
        assert abs(again["error"]) <= TOLERANCE, again
        assert again["sim_s"] == pytest.approx(rows[i]["sim_s"], rel=1e-6), RINGS[i].name


def test_overlap_plans_leave_the_room_and_carry_the_depth_only_when_on(h100):
    """overlap_rank_plans plans each rank under a smaller device budget, says its depth in
    RankPlan.round_overlap (in its JSON), and the plain plans' JSON has no such key; the
    compiled ring step refuses a plan with it by name."""
    cfg = load_config("8b")
    prof = ring_profile(h100, 4, "nccl")
    budget = Budget.from_gib(30, 24)
    plain = make_rank_plans(cfg, 8192, budget, prof, 4, chunks_per_round=4)
    assert "round_overlap" not in plain[0].to_json()
    over = overlap_rank_plans(cfg, 8192, budget, prof, 4, 2, chunks_per_round=4)
    assert [rp.round_overlap for rp in over] == [2] * 4
    assert '"round_overlap": 2' in over[0].to_json()
    assert over[0].plan.budget.device_bytes < budget.device_bytes
    assert ring_depth(over) >= 2
    link = LINKS[0]
    assert predict_ring(over, link, overlap=True).overlap_depth == ring_depth(over)
    assert predict_ring(over, link).overlap_depth == 0
    with pytest.raises(ConfigError, match="round_overlap"):
        compile_ring_schedule(over[1])
    with pytest.raises(ValueError, match="depth"):
        overlap_rank_plans(cfg, 8192, budget, prof, 4, 0)


def test_choose_layout_weighs_overlap_and_off_means_off(h100):
    """A ring of 4 of 8b at 30/24: with overlap the chooser keeps an overlapped plan predicted
    faster than the ring in turn; round_overlap=False gives the layout with no overlap key (its
    JSON as before)."""
    cfg = load_config("8b")
    on = choose_layout(cfg, 8192, Budget.from_gib(30, 24), h100, 4, ring_size=4,
                       single_tok_per_s=None, quick=True)
    off = choose_layout(cfg, 8192, Budget.from_gib(30, 24), h100, 4, ring_size=4,
                        single_tok_per_s=None, quick=True, round_overlap=False)
    assert on.chosen.layout.round_overlap >= 1
    assert ("round_overlap", on.rank_plans[0].round_overlap) in on.chosen.constraints
    assert off.chosen.layout.round_overlap == 0
    assert "round_overlap" not in json.dumps(off.to_json_dict())
    assert on.chosen.on("nvlink").tok_per_s > off.chosen.on("nvlink").tok_per_s
    assert on.chosen.on("nvlink").bubble_frac < off.chosen.on("nvlink").bubble_frac


def test_the_command_lines_turn_it_off_and_dataflow_ring_takes_a_depth(capsys):
    """dataflow-plan takes --no-round-overlap; dataflow-ring takes --no-round-overlap (its
    default: rounds in turn) and --round-overlap with a depth or without one (the planner's),
    and refuses with exit 2, naming the flag before any process starts, a depth of 0 and
    --round-overlap over NCCL (CuPy's default transport, which does not run it)."""
    from dataflow.cli import plan as plan_cli  # the console scripts sit above every package
    from dataflow.cli import ring as ring_cli  # the console scripts sit above every package
    from dataflow.ring.layout import AUTO_OVERLAP

    args = plan_cli.build_parser().parse_args(["80", "24", "8192", "8b", "--gpus", "4",
                                               "--no-round-overlap"])
    assert args.no_round_overlap
    assert not plan_cli.build_parser().parse_args(["80", "24", "8192", "8b"]).no_round_overlap
    parse = ring_cli.build_parser().parse_args
    assert parse(["8", "1", "64", "tiny", "--no-round-overlap"]).no_round_overlap
    assert parse(["8", "1", "64", "tiny"]).round_overlap is None
    assert parse(["8", "1", "64", "tiny", "--round-overlap"]).round_overlap == AUTO_OVERLAP
    assert parse(["8", "1", "64", "tiny", "--round-overlap", "2"]).round_overlap == 2
    assert ring_cli.main(["8", "1", "64", "tiny", "--gpus", "2", "--round-overlap", "0"]) == 2
    assert "--round-overlap" in capsys.readouterr().err
    assert ring_cli.main(["8", "1", "64", "tiny", "--gpus", "2", "--backend", "cupy",
                          "--round-overlap"]) == 2
    assert "--round-overlap" in capsys.readouterr().err


def test_an_overlapped_layout_counts_the_overlaps_memory_within_the_budgets(h100):
    """The chosen overlapped ring's per-device bytes include what the overlap holds (its
    activations and second residual rows) and still fit the device budget less the libraries'
    reserve, and the host budget."""
    cfg = load_config("8b")
    budget = Budget.from_gib(30, 24)
    on = choose_layout(cfg, 8192, budget, h100, 4, ring_size=4, single_tok_per_s=None,
                       quick=True)
    depth = on.chosen.layout.round_overlap
    assert depth >= 1
    plain_dev = max(rp.plan.memory.device_bytes for rp in on.rank_plans)
    assert on.chosen.device_bytes > plain_dev
    reserve = on.rank_plans[0].plan.profile.library_reserve_bytes
    assert on.chosen.device_bytes <= budget.device_bytes - reserve
    assert on.chosen.host_bytes <= budget.host_bytes
