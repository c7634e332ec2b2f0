"""Placements other than cyclic (issue 38): the owner sequence of a balanced or contiguous ring is
a walk around the ring from rank 0 to the head's rank, its ranks' schedules pair every Send with
its Recv (runs of consecutive layers on one rank send and receive only at their ends), and a
balanced ring trains bit for bit as one device does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.ranks import PLACEMENTS, RankPlan, head_rank, layer_owners, owned_layers
from dataflow.memplan.search.ring_plan import (head_layer_units, make_rank_plan, make_rank_plans,
    ring_profile)
from dataflow.memplan.step.ring_compile import compile_ring_schedule
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.serial import from_json
from tests.ring.small_rings import BUDGET, CHUNKING, CPU, sends_pair_with_receives, tiny_with
from tests.ring.threads import in_threads, sanitized_pair_trains_as_one_device

def _cfg(n_layers: int):
    return tiny_with(n_layers, name=f"tiny{n_layers}")


def _runs(owners) -> int:
    """The longest run of consecutive layers on one rank."""
    best = cur = 1
    for a, b in zip(owners, owners[1:]):
        cur = cur + 1 if a == b else 1
        best = max(best, cur)
    return best


def test_owner_sequences_walk_the_ring_from_rank_0_to_the_head_rank(rng):
    """Every placement deals each layer once, starts on rank 0, ends on the head's rank and
    steps only to the same or the next rank; cyclic is i mod N; balanced gives the head's rank
    the fewest layers and keeps the most any rank runs (its layers, plus the head's cost on the
    head's rank) as low as any split can."""
    for _ in range(40):
        n_layers = int(rng.integers(2, 60))
        n = int(rng.integers(1, min(n_layers, 9) + 1))
        h = float(rng.uniform(0.0, 4.0))
        for placement in PLACEMENTS:
            owners = layer_owners(n_layers, n, placement, h)
            assert len(owners) == n_layers and owners[0] == 0, (placement, owners)
            assert all(b in (a, (a + 1) % n) for a, b in zip(owners, owners[1:])), owners
            assert sorted(sum((owned_layers(n_layers, n, r, owners) for r in range(n)), ())) \
                == list(range(n_layers))
            assert head_rank(n_layers, n, owners) == owners[-1]
            if placement == "cyclic":
                assert owners == tuple(i % n for i in range(n_layers))
                assert head_rank(n_layers, n, owners) == head_rank(n_layers, n)
                continue
            counts = [owners.count(r) for r in range(n)]
            if n == 1:
                continue
            assert owners[-1] == n - 1 and counts[-1] == min(counts), (owners, h)
            load = max(max(counts[:-1]), counts[-1] + h)
            best = min(max(-(-(n_layers - k) // (n - 1)), k + h) for k in range(1, n_layers))
            assert load == pytest.approx(best), (counts, h)
            visits = sum(1 for i, r in enumerate(owners) if i == 0 or owners[i - 1] != r)
            assert visits == (n if placement == "contiguous" else n * counts[-1])
    # the example: 32 layers, 2 ranks, a head worth 2 layers
    owners = layer_owners(32, 2, "balanced", 2.0)
    assert (owners.count(0), owners.count(1)) == (17, 15) and _runs(owners) == 2
    with pytest.raises(ConfigError, match="known: cyclic, balanced, contiguous"):
        layer_owners(8, 2, "blocky")


def test_balanced_rank_plans_share_the_owners_and_one_chunking():
    """make_rank_plans and make_rank_plan (each process alone) agree on the owners, the head's
    rank and the chunking; the placement survives JSON and a plan written before placements
    loads as cyclic."""
    cfg = _cfg(8)
    plans = make_rank_plans(cfg, 64, BUDGET, CPU, 3, placement="balanced", **CHUNKING)
    owners = plans[0].owners
    assert owners == layer_owners(8, 3, "balanced",
                                  head_layer_units(cfg, plans[0].plan.chunking, CPU))
    assert len({rp.plan.chunking for rp in plans}) == 1
    assert [rp.layers for rp in plans] == [owned_layers(8, 3, r, owners) for r in range(3)]
    assert [rp.has_head for rp in plans] == [False, False, True]
    for rp in plans:
        assert rp.plan.model.n_layers == len(rp.layers)
        alone = make_rank_plan(cfg, 64, BUDGET, CPU, 3, rp.rank, placement="balanced",
                               **CHUNKING)
        assert alone == rp
        assert from_json(RankPlan, rp.to_json()) == rp
    cyclic = make_rank_plans(cfg, 64, BUDGET, CPU, 3, **CHUNKING)[1]
    assert "placement" not in cyclic.to_json() and "owners" not in cyclic.to_json()
    assert from_json(RankPlan, cyclic.to_json()).ring_owners == layer_owners(8, 3)


@pytest.mark.parametrize("n_ranks,n_layers,placement",
                         [(2, 5, "balanced"), (3, 8, "balanced"), (3, 7, "contiguous")])
def test_every_send_of_a_ring_with_runs_has_its_receive(n_ranks, n_layers, placement):
    """With runs of consecutive layers on a rank, each Send still meets its Recv on the
    neighbour, and only messages between ranks are sent: forward and backward, one per chunk
    and round for every layer whose next layer lives on another rank."""
    plans = make_rank_plans(_cfg(n_layers), 64, BUDGET, CPU, n_ranks, placement=placement,
                            **CHUNKING)
    owners = plans[0].owners
    assert _runs(owners) >= 2, owners  # the schedules hold runs
    hops = sum(a != b for a, b in zip(owners, owners[1:]))
    assert sends_pair_with_receives(plans) == 2 * hops * 2 * 2


def test_a_ring_rank_refuses_a_segment_recompute_plan():
    """A rank's consecutive local layers need not be consecutive layers of the model, so a plan
    that recomputes layer segments is refused by the ring's compiler, naming it."""
    rp = make_rank_plans(_cfg(5), 64, BUDGET, CPU, 2, placement="balanced", **CHUNKING)[0]
    bad = dataclasses.replace(rp, plan=dataclasses.replace(rp.plan, segment_layers=2))
    with pytest.raises(ConfigError, match="segments of 2 layers"):
        compile_ring_schedule(bad)


@pytest.mark.parametrize("n_ranks,n_layers,placement",
                         [(2, 5, "balanced"), (3, 8, "balanced"), (3, 7, "contiguous")])
def test_a_ring_with_runs_trains_as_one_device_bit_for_bit(rng, n_ranks, n_layers, placement):
    """Engine(..., ring=Ring(placement=...)) in threads, the ranks owning runs of consecutive
    layers: on the same global batches they give one device's losses and final weights of every
    block bit for bit (clipping off: the norm's partial sums would be added in another order)."""
    from dataflow.ring.engine import Ring, RingEngine
    from dataflow.ring.env import RankEnv

    cfg = _cfg(n_layers)
    seed = int(rng.integers(0, 2**31))
    common = dict(host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", seed=seed, lr=1e-2,
                  max_grad_norm=None, plan_options=dict(CHUNKING))
    with Engine(cfg, **common) as eng:
        rows = eng.seqs_per_step
        data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(2)]
        want_losses = [eng.train_step(b).loss for b in data]
        w = eng.weights()
    want = {"embed": w.embed, "head": w.head, **{f"layer{i}": b for i, b in enumerate(w.layers)}}

    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=n_ranks, local_rank=r, master_addr="127.0.0.1",
                      master_port=0, run_id=run_id)
        with Engine(cfg, ring=Ring(env=env, replicas=1, timeout_s=30, placement=placement),
                    **common) as eng:
            assert isinstance(eng, RingEngine) and eng.rank_plan.placement == placement
            return eng.rank_plan.owners, [eng.train_step(b).loss for b in data], eng.weights()

    got, owners = {}, set()
    for own, losses, blocks in in_threads(rank, n_ranks):
        assert losses == want_losses, (losses, want_losses)
        owners.add(own)
        got.update(blocks)
    assert len(owners) == 1 and _runs(owners.pop()) >= 2
    assert sorted(got) == sorted(want)
    for key in want:
        assert np.array_equal(got[key].view(np.uint16), want[key].view(np.uint16)), key
    assert want_losses[1] != want_losses[0]


def test_a_balanced_ring_runs_clean_under_the_schedule_sanitizer(rng):
    """A balanced ring of 2 (rank 0 runs layers 2-3 back to back) on the sanitizing NumPy
    backend, whose ops run in a random order that respects the events and which reports any
    two unordered accesses to the same bytes: no race, and one device's losses bit for bit."""
    cfg = _cfg(5)
    plans = make_rank_plans(cfg, 64, BUDGET, CPU, 2, placement="balanced", **CHUNKING)
    assert plans[0].layers == (0, 2, 3)
    sanitized_pair_trains_as_one_device(cfg, plans, rng, CHUNKING)


def test_a_balanced_ring_of_2_evens_the_ranks_own_predictions_for_8b():
    """8b at 8k, 60 / 24 GiB per H100 (NCCL's reserve planned): the head is worth about two
    layers, so the head's rank owns 15 layers to rank 0's 17 and the ranks' own predicted steps
    come within a few percent of each other (cyclic: 21,063 against 18,672 tok/s). Whether the
    ring is faster for it is predict_ring's to say (see the next test)."""
    cfg = load_config("8b")
    prof = ring_profile(get_profile("h100"), 2, "nccl")
    budget = Budget.from_gib(60, 24)
    cyc = make_rank_plans(cfg, 8192, budget, prof, 2)
    bal = make_rank_plans(cfg, 8192, budget, prof, 2, placement="balanced")
    assert [len(rp.layers) for rp in bal] == [17, 15] and bal[1].has_head
    assert 1.5 < head_layer_units(cfg, bal[0].plan.chunking, prof) < 3.0
    alone = [rp.plan.prediction.tok_per_s for rp in bal]
    assert min(alone) > 0.97 * max(alone), alone
    cyc_alone = [rp.plan.prediction.tok_per_s for rp in cyc]
    assert min(cyc_alone) < 0.9 * max(cyc_alone), cyc_alone


def test_choose_layout_weighs_placements_when_asked_and_hands_the_ranks_the_choice():
    """choose_layout weighs the placements (WEIGHED_PLACEMENTS, the default) and keeps the one
    predict_ring puts ahead for 8b on 2 H100s; an option's constraints carry a placement other
    than cyclic, which is what dataflow-ring's resolve_layout hands every rank."""
    from dataflow.memplan.search.layout import WEIGHED_PLACEMENTS, choose_layout

    cfg, prof, budget = load_config("8b"), get_profile("h100"), Budget.from_gib(60, 24)

    def choice(**kw):
        return choose_layout(cfg, 8192, budget, prof, 2, ring_size=2, single_tok_per_s=None,
                             **kw)

    plain = choice(placements=("cyclic",))
    assert plain.chosen.layout.placement == "cyclic"
    assert "placement" not in dict(plain.chosen.constraints)
    bal = choice(placements=("balanced",))
    assert bal.chosen.layout.placement == "balanced"
    assert dict(bal.chosen.constraints)["placement"] == "balanced"
    assert all(rp.placement == "balanced" for rp in bal.rank_plans)
    both = choice()
    assert choice(placements=WEIGHED_PLACEMENTS).chosen == both.chosen
    faster = max((plain, bal), key=lambda c: c.chosen.on("nvlink").tok_per_s)
    assert both.chosen.layout.placement == faster.chosen.layout.placement
    assert both.chosen.on("nvlink").tok_per_s == faster.chosen.on("nvlink").tok_per_s


def test_ring_cli_resolves_a_placement_into_the_job(monkeypatch, capsys):
    """dataflow-ring --placement balanced: resolve_layout's constraints carry it, and main puts
    it into the RingJob every rank receives."""
    import dataflow.cli.ring as cli
    from dataflow.ring.kinds import TransportKind
    from dataflow.ring.layout import resolve_layout

    _, constraints = resolve_layout(
        "small", 64, 1.0, 1.0, 2, backend="numpy", transport=TransportKind.SHM, replicas=1,
        tokens_per_step=None, rounds=None, quiet=True, placement="balanced")
    assert dict(constraints)["placement"] == "balanced"
    jobs = []
    monkeypatch.setattr(cli, "run_job", lambda job, *a, **k: jobs.append(job) or 0)
    assert cli.main(["1", "1", "64", "small", "--gpus", "2", "--replicas", "1",
                     "--placement", "balanced"]) == 0
    assert jobs[0].placement == "balanced" and "placement" not in dict(jobs[0].constraints)
