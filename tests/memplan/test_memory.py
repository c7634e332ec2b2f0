"""The memory map: named regions in a fixed order, sized by memplan/plan/buffers.py, and the rules
that decide which exist (docs/planner.md)."""

import dataclasses

import pytest

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import Decisions, validate_decisions
from dataflow.memplan.plan.memory import device_regions, host_regions, memory_map, region_category
from dataflow.memplan.plan.plan import GradAccum, LayerPlacement, OptimizerWhere, Where
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel

from .forced import HOME_HOST, HOME_STREAMED, RESIDENT, acts, cfg_of, forced


def _names(regions):
    return [n for n, _ in regions]


def test_all_resident_plan_regions_and_sizes(h100):
    """Resident layers, embed and head carry weights, grads, m, v; fixed buffers follow (on the
    host: setup staging, token staging, and the pinned gradient-norm scalars)."""
    plan = forced(h100, "tiny", 64, chunk_tokens=128, chunks_per_round=2)
    cfg, el = plan.model, buffers.block_elems(plan.model)
    dev = dict(device_regions(plan))
    assert _names(device_regions(plan))[:4] == ["layer0.weights", "layer0.grads", "layer0.m",
                                                 "layer0.v"]
    assert dev["layer1.grads"] == el["layer"] * 2 and dev["embed.m"] == el["embed"] * 2
    assert dev["head.weights"] == el["head"] * 2 and "head.v" in dev
    assert dev["act.1.1"] == buffers.saved_activation_bytes(cfg, 128, SavedLevel.FULL)
    assert dev["workspace"] == buffers.packed_bytes(buffers.chunk_workspace_specs(cfg, 128))
    assert dev["transitions"] == buffers.packed_bytes(buffers.transition_specs(cfg, 256))
    assert "weight_slots" not in dev and "act_slots" not in dev and "opt_stage" not in dev
    assert _names(host_regions(plan)) == ["io_staging", "tokens", "norm_host"]
    assert all(n % buffers.ALIGN_BYTES == 0 for _, n in device_regions(plan) + host_regions(plan))


def test_streamed_layers_use_slots_and_home_state(h100):
    """HOME layers get home weights/grads/m/v and the device gets ws and gs slots."""
    plan = forced(h100, "small", 256, chunk_tokens=256, layers=(HOME_STREAMED,) * 4,
                  weight_slots=3, grad_slots=2, opt_stage_elems=1000, grad_accum=GradAccum.FP32)
    el = buffers.block_elems(plan.model)["layer"]
    dev, host = dict(device_regions(plan)), dict(host_regions(plan))
    assert dev["weight_slots"] == 3 * el * 2 and dev["grad_slots"] == 2 * el * 4
    assert host["home.layer2.grads"] == el * 4 and host["home.layer2.m"] == el * 2
    assert dev["opt_stage"] == buffers.packed_bytes(buffers.opt_stage_specs(1000, "f32"))
    assert not any(n.startswith("layer") for n in dev)


def test_home_activations_and_slot_size_is_largest_home_level(h100):
    """Home activations live on the host; act_slots is slots x the largest home level."""
    cfg = cfg_of("tiny")
    a = list(map(list, acts(2, 2, SavedLevel.INP_ONLY, Where.HOME)))
    a[1][0] = dataclasses.replace(a[1][0], level=SavedLevel.INP_ATTN)
    a[0][1] = dataclasses.replace(a[0][1], home=Where.DEVICE, level=SavedLevel.FULL)
    plan = forced(h100, "tiny", 64, chunk_tokens=64, chunks_per_round=2, activations=a,
                  act_slots=3)
    dev, host = dict(device_regions(plan)), dict(host_regions(plan))
    attn = buffers.saved_activation_bytes(cfg, 64, SavedLevel.INP_ATTN)
    assert dev["act_slots"] == 3 * attn and "act.0.1" in dev and "act.0.0" not in dev
    assert host["home.act.1.0"] == attn and "home.act.0.1" not in host


def test_embed_at_home_needs_no_device_region_and_head_always_has_two(h100):
    """Embed HOME: no device region, rows staging on the host (one round a step: one buffer,
    the gathered rows and then the gradient rows over them); head HOME: weights and grads
    regions stay on the device, m and v go home."""
    plan = forced(h100, "tiny", 64, embed=HOME_HOST, head=HOME_STREAMED, opt_stage_elems=64)
    dev, host = dict(device_regions(plan)), dict(host_regions(plan))
    assert not any(n.startswith("embed") for n in dev)
    assert "head.weights" in dev and "head.grads" in dev and "head.m" not in dev
    assert {"home.embed.weights", "home.embed.v", "home.head.m", "embed_rows"} <= set(host)
    assert plan.chunking.rounds_per_step == 1 and host["embed_rows"] == 1 * 64 * 64 * 2
    two = forced(h100, "tiny", 64, chunk_tokens=64, rounds=2, embed=HOME_HOST)
    assert two.chunking.tokens_per_round == 64
    assert dict(host_regions(two))["embed_rows"] == 2 * 64 * 64 * 2  # alternate rounds


def test_memory_map_sums_regions_by_category(h100):
    """The six categories sum to the regions' bytes on each side."""
    plan = forced(h100, "small", 512, chunk_tokens=256, chunks_per_round=2,
                  layers=(RESIDENT, HOME_HOST, RESIDENT, HOME_HOST), weight_slots=1, grad_slots=1)
    mm = memory_map(plan)
    assert [c for c, _ in mm.device] == ["weights", "grads", "optimizer_state",
                                         "saved_activations", "workspaces", "buffers"]
    assert mm.device_bytes == sum(n for _, n in device_regions(plan))
    assert mm.host_bytes == sum(n for _, n in host_regions(plan))
    assert plan.memory == mm
    assert region_category("home.layer3.v") == "optimizer_state"


@pytest.mark.parametrize("triple", [
    (Where.DEVICE, Where.HOME, OptimizerWhere.DEVICE),
    (Where.HOME, Where.DEVICE, OptimizerWhere.HOST),
    (Where.HOME, Where.HOME, OptimizerWhere.DEVICE),
    (Where.DEVICE, Where.DEVICE, OptimizerWhere.HOST)])
def test_placement_outside_the_allowed_triples_is_refused(h100, triple):
    """Only (D, D, D), (H, H, STREAMED) and (H, H, HOST) are allowed, for layers and head."""
    bad = LayerPlacement(weights=triple[0], grads=triple[1], optimizer=triple[2])
    with pytest.raises(ConfigError, match="not allowed"):
        forced(h100, layers=(bad, RESIDENT), weight_slots=1, grad_slots=1, opt_stage_elems=8)
    with pytest.raises(ConfigError, match="head placement"):
        forced(h100, head=bad, opt_stage_elems=8)


def test_missing_slots_are_refused_with_a_way_out(h100):
    """Streamed weights need weight_slots >= 1; home activations need act_slots >= 1."""
    with pytest.raises(ConfigError, match="weight_slots is 0"):
        forced(h100, layers=(HOME_HOST, RESIDENT), grad_slots=1)
    with pytest.raises(ConfigError, match="act_slots is 0"):
        forced(h100, activations=acts(2, 1, home=Where.HOME))
    with pytest.raises(ConfigError, match="opt_stage_elems"):
        forced(h100, layers=(HOME_STREAMED,) * 2, weight_slots=1, grad_slots=1)


def test_chunking_rules_are_enforced(h100):
    """Packing needs chunk = k x seqlen; splitting needs seqlen = n x chunk and whole
    sequences per round."""
    with pytest.raises(ConfigError, match="multiple of seqlen"):
        forced(h100, "tiny", 64, chunk_tokens=96)
    with pytest.raises(ConfigError, match="divide"):
        forced(h100, "tiny", 256, chunk_tokens=96)
    with pytest.raises(ConfigError, match="multiple of chunks_per_seq"):
        forced(h100, "tiny", 256, chunk_tokens=64, chunks_per_round=6)
    plan = forced(h100, "tiny", 64, chunk_tokens=64)
    d = Decisions(model=plan.model, chunking=dataclasses.replace(plan.chunking, seqs_per_chunk=2),
                  slots=plan.slots, layers=plan.layers, activations=plan.activations,
                  embed=plan.embed, head=plan.head, grad_accum=plan.grad_accum)
    with pytest.raises(ConfigError, match="packs sequences"):
        validate_decisions(d)


def test_activation_table_shape_is_checked(h100):
    """activations must be n_layers rows of chunks_per_round entries."""
    with pytest.raises(ConfigError, match="rows"):
        forced(h100, "tiny", 64, activations=acts(2, 2))


@pytest.mark.parametrize("model,seqlen,segments", [("small", 2048, False), ("1b", 131072, False),
                                                   ("8b", 524288, True)])
def test_candidate_memory_never_counts_the_embedding_rows_short(h100, prng, model, seqlen,
                                                                segments):
    """A search candidate's memory is taken at the rounds of its lower bound (the most its plan
    can run): for sampled candidates with a HOME embedding, device bytes equal the materialised
    plan's at the scored rounds, host bytes are at least its own, and equal unless the bound
    allowed several rounds while the plan runs one (then exactly one part of rows more: 1b at
    131072 has such candidates)."""
    from dataflow.memplan.search.cost import max_rounds, rounds_for_target
    from dataflow.memplan.search.search import _decisions, _options, _table

    cfg = load_config(model)
    frac = dict(_options(cfg, {}))["target_optimizer_frac"]
    table = _table(cfg, seqlen, h100, GradAccum.BF16, {}, segments=segments)

    def bound(c):
        sp = table.spaces[c.space]
        lb = sp.round_lower_bound_s(c.state)
        return rounds_for_target(lb, lb, sp.optimizer(c.state).time_s, frac,
                                 max_rounds(sp.ch.tokens_per_round))

    home = [c for c in table.candidates if not c.state.embed_dev]
    one = [c for c in home if bound(c) == 1]
    more = [c for c in home if bound(c) > 1]
    picked = prng.sample(one, min(40, len(one))) + prng.sample(more, min(40, len(more)))
    picked += [c for c in more if table.score(c).rounds_per_step == 1][:20]
    seen = set()
    for c in picked:
        sp = table.spaces[c.space]
        mm = memory_map(_decisions(table, c))
        rounds = table.score(c).rounds_per_step
        assert c.device_bytes == mm.device_bytes + h100.library_reserve_bytes
        assert rounds <= bound(c)
        part = sp.ch.tokens_per_round * cfg.model_dim * 2
        one_more = buffers.align(2 * part) - buffers.align(part)
        short = bound(c) > 1 and rounds == 1
        assert c.host_bytes - mm.host_bytes == (one_more if short else 0), (c.state, rounds)
        seen.add((bound(c) > 1, rounds > 1))
    if model == "1b":  # the one case that counts a part more was checked
        assert (True, False) in seen
