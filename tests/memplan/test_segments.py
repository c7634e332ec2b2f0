"""Layer-segment recompute in the planner: a segment State's memory and work equal the full plan
it materialises to, segment plans keep only the boundary layers' activations plus storage for one
segment's rebuilt ones, the recompute is timed (compute, HFU, the compiled schedule) and the
search turns to segments only when nothing cheaper fits."""

import dataclasses

import pytest

from dataflow.memplan.plan.chunking import chunking_candidates
from dataflow.memplan.search.cost import KEEPS_ATTN_OUT, workload_of
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.plan.memory import device_regions, host_regions, memory_map
from dataflow.memplan.plan.plan import GradAccum, Where
from dataflow.memplan.step.compile import Compute, compile_schedule
from dataflow.memplan.search.space import ACT_CLASSES, Space
from dataflow.models.config import load_config
from tests.memplan.test_space import _random_state


@pytest.mark.parametrize("model,seqlen", [("tiny", 256), ("small", 2048), ("8b", 65536)])
def test_segment_state_memory_and_work_match_the_materialised_plan(prng, h100, model, seqlen):
    """For random segment lengths, inner classes and States, Space.memory equals memory_map and
    Space.workload equals workload_of on the decisions the State materialises to."""
    cfg = load_config(model)
    for ch in chunking_candidates(cfg, seqlen)[:3]:
        for _ in range(3):
            k = prng.randint(2, cfg.n_layers)
            sp = Space(cfg, ch, h100, prng.choice(list(GradAccum)), k, prng.randrange(6))
            s = _random_state(prng, sp)
            d = sp.decisions(s, rounds_per_step=2)
            assert d.segment_layers == k
            mm = memory_map(d)
            reserve = getattr(h100, "library_reserve_bytes", 0)  # beside the arena
            assert sp.memory(s, 2) == (mm.device_bytes + reserve, mm.host_bytes), (k, s)
            one = memory_map(sp.decisions(s, rounds_per_step=1))
            assert sp.memory(s, 1) == (one.device_bytes + reserve, one.host_bytes), (k, s)
            fast, full = sp.workload(s), workload_of(d, h100)
            for f in dataclasses.fields(full):
                a, b = getattr(fast, f.name), getattr(full, f.name)
                assert a == pytest.approx(b, rel=1e-12), (f.name, k, s)
            assert sp.round_lower_bound_s(s) <= full.compute_s + full.recompute_s + 1e-12


def test_8b_at_256k_fits_120_24_only_with_segments(h100):
    """8b at 262144 tokens: no plan without segments fits host 120 / device 24 GiB (they need
    ~159 GiB of host); make_plan turns to layer segments and the plan fits both budgets, its
    recompute counted in HFU only."""
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.search.search import make_plan

    cfg, budget = load_config("8b"), Budget.from_gib(120, 24)
    plan = make_plan(cfg, 262144, budget, h100)
    assert 2 <= plan.segment_layers < cfg.n_layers
    assert plan.memory.host_bytes <= budget.host_bytes
    pr = plan.prediction
    assert pr.recompute_s > 0 and pr.hfu > pr.mfu
    from dataflow.memplan.search.candidates import candidate_table
    from dataflow.memplan.search.search import _options

    plain_table = candidate_table(cfg, 262144, h100, GradAccum.BF16, _options(cfg, {}))
    assert not any(c.device_bytes <= budget.device_bytes and c.host_bytes <= budget.host_bytes
                   for c in plain_table.candidates)
    plain = make_plan(cfg, 262144, Budget.from_gib(200, 24), h100)
    assert plain.segment_layers == 1  # with room, no segments


def test_refusal_names_smallest_budgets_with_and_without_segments(h100):
    """8b at 524288 within host 120 GiB: the message names the smallest pair (segments
    included, also in the fields) and the pair without segments, which needs more host."""
    from dataflow.memplan.plan.errors import InfeasibleBudget
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.search.search import make_plan, minimum_budgets

    cfg = load_config("8b")
    with pytest.raises(InfeasibleBudget) as exc:
        make_plan(cfg, 524288, Budget.from_gib(100, 24), h100)
    msg, mb = str(exc.value), minimum_budgets(cfg, 524288, h100)
    assert f"host {mb.host_gib:.1f} GiB with device {mb.device_gib:.1f} GiB" in msg
    assert "(with layer-segment recompute; without it host " in msg and "\n" not in msg
    without = float(msg.split("without it host ")[1].split(" GiB")[0])
    assert without > mb.host_gib + 50
    assert exc.value.min_host_bytes == mb.host_bytes


def _tiny4_plan(k):
    """tiny with four layers, streamed, one chunk's activations at home and one on the device."""
    from dataflow.memplan.plan.plan import Budget, OptimizerWhere
    from dataflow.memplan.search.build import with_segments
    from tests.dataflow.plans import forced_plan, streamed

    cfg = dataclasses.replace(load_config("tiny"), n_layers=4)
    plan = forced_plan(cfg, 64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2, rounds=2,
                       layers=(streamed(OptimizerWhere.STREAMED),) * 4,
                       homes=[[Where.HOME, Where.DEVICE]] * 4)
    return with_segments(plan, k, Budget(host_bytes=1 << 34, device_bytes=1 << 34))


def test_schedule_times_the_segment_recompute(h100):
    """The compiled schedule of a k = 2 plan holds one recompute forward per (layer, chunk) of
    each segment, right before that segment's backward, keeps nothing of inner layers in the
    forward; the simulated step's recompute grows by exactly those forwards' seconds (a
    boundary's without attention where it kept its attention output); the
    schedule round-trips through JSON and an older plan file (no segment_layers) loads as k=1."""
    from dataflow.memplan.search.cost import chunk_costs
    from dataflow.memplan.plan.plan import Plan
    from dataflow.memplan.step.compile import Schedule

    plain, seg = _tiny4_plan(1), _tiny4_plan(2)
    sch = compile_schedule(seg)
    rnd0 = sch.events[sch.round_starts[0]:sch.round_starts[1]]
    computes = [e for e in rnd0 if type(e) is Compute and e.op.startswith("layer_")]
    refwd = [(e.layer, e.chunk) for e in computes if e.op == "layer_refwd"]
    assert refwd == [(2, 0), (2, 1), (3, 0), (3, 1), (0, 0), (0, 1), (1, 0), (1, 1)]
    first_bwd = {e.layer: i for i, e in reversed(list(enumerate(computes)))
                 if e.op == "layer_bwd"}
    last_re = {e.layer: i for i, e in enumerate(computes) if e.op == "layer_refwd"}
    assert last_re[3] < first_bwd[3] and first_bwd[2] < last_re[0] < first_bwd[1]
    assert all(e.save is None for e in computes if e.op == "layer_fwd" and e.layer % 2)
    assert Schedule.from_json(sch.to_json()).events == sch.events
    names = [n for n, _ in device_regions(seg)] + [n for n, _ in host_regions(seg)]
    assert "home.act.seg1.0" in names and "act.seg1.1" in names and "act.1.1" not in names
    costs = chunk_costs(seg.model, seg.chunking, seg.profile)
    fwd = sum(c.fwd_s for c in costs)
    # a boundary (layers 0, 2) that kept its attention output re-runs without attention
    kept_off = sum(cc.fwd_s - cc.refwd_kept_s for layer in (0, 2) for cc, a in
                   zip(costs, seg.activations[layer]) if a.level in KEEPS_ATTN_OUT)
    extra = predict_schedule(seg, h100).recompute_s - predict_schedule(plain, h100).recompute_s
    assert extra == pytest.approx(seg.chunking.rounds_per_step * (4 * fwd - kept_off), rel=1e-9)
    old = seg.to_json().replace('"segment_layers": 2,', "")
    assert Plan.from_json(old).segment_layers == 1
    assert Plan.from_json(seg.to_json()) == seg
