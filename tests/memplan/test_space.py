"""The search's compact States agree exactly with the full plans they stand for: same memory as
memory.py computes, same per-round work as cost.py derives."""

import dataclasses

import pytest

from dataflow.memplan.plan.chunking import chunking_candidates
from dataflow.memplan.search.cost import workload_of
from dataflow.memplan.plan.memory import memory_map
from dataflow.memplan.plan.plan import GradAccum
from dataflow.memplan.plan.split import split_memory_map
from dataflow.memplan.search.space import Space, State, spread_order
from dataflow.models.config import load_config


def _random_state(r, sp: Space) -> State:
    N = sp.N
    cuts = sorted(r.randint(0, N) for _ in range(5))
    counts = [b - a for a, b in zip([0] + cuts, cuts + [N])]
    return State(resident=r.randint(0, sp.L), embed_dev=r.random() < .5, head_dev=r.random() < .5,
                 opt_streamed=r.random() < .5, weight_slots=r.randint(1, 4),
                 grad_slots=r.randint(1, 3), act_slots=r.randint(1, 5), acts=tuple(counts))


@pytest.mark.parametrize("model,seqlen", [("tiny", 256), ("small", 2048), ("8b", 65536),
                                          ("1b", 512)])
def test_state_memory_and_work_match_the_materialised_plan(prng, h100, model, seqlen):
    """For random States, Space.memory equals memory_map (at one round a step and at more: a
    HOME embedding's rows take one part or two) and Space.workload equals workload_of on the
    decisions the State materialises to."""
    cfg = load_config(model)
    for ch in chunking_candidates(cfg, seqlen):
        for accum in GradAccum:
            sp = Space(cfg, ch, h100, accum)
            for _ in range(4):
                s = _random_state(prng, sp)
                for rounds in (1, 3):
                    mm = memory_map(sp.decisions(s, rounds_per_step=rounds))
                    assert sp.memory(s, rounds) == (mm.device_bytes + sp.p.library_reserve_bytes,
                                                    mm.host_bytes), (s, rounds)
                d = sp.decisions(s, rounds_per_step=2)
                mm = memory_map(d)
                assert sp.memory(s, 2) == (mm.device_bytes + sp.p.library_reserve_bytes,
                                           mm.host_bytes), s
                fast, full = sp.workload(s), workload_of(d, h100)
                for f in dataclasses.fields(full):
                    a, b = getattr(fast, f.name), getattr(full, f.name)
                    assert a == pytest.approx(b, rel=1e-12), (f.name, s)
                assert sp.round_lower_bound_s(s) <= full.compute_s + full.recompute_s + 1e-12


@pytest.mark.parametrize("model,seqlen,parts", [("tiny", 256, 3), ("small", 2048, 2),
                                                ("8b", 8192, 8)])
def test_a_split_replicas_state_memory_matches_its_materialised_plan(prng, h100, model, seqlen,
                                                                      parts):
    """With m / v of the layers and the head for one part (Space(state_parts=R), a split-update
    replica's), Space.memory equals memory_map of the decisions, and both equal the whole
    decisions' memory map cut afterwards (split.split_memory_map)."""
    cfg = load_config(model)
    for ch in chunking_candidates(cfg, seqlen)[:3]:
        sp = Space(cfg, ch, h100, GradAccum.FP32, state_parts=parts)
        whole = Space(cfg, ch, h100, GradAccum.FP32)
        for _ in range(4):
            s = _random_state(prng, sp)
            d = sp.decisions(s, rounds_per_step=2)
            mm = memory_map(d)
            assert d.state_parts == parts
            assert sp.memory(s, 2) == (mm.device_bytes + sp.p.library_reserve_bytes,
                                       mm.host_bytes), s
            assert split_memory_map(whole.decisions(s, rounds_per_step=2), parts) == mm, s


def test_spread_order_prefixes_are_even():
    """Every prefix of the spread order takes layers from across the whole stack."""
    order = spread_order(32)
    assert sorted(order) == list(range(32))
    assert sorted(order[:4]) == [0, 8, 16, 24]
    assert sorted(spread_order(5)) == list(range(5))
