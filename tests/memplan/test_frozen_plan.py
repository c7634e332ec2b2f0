"""Frozen blocks in the planner (issue 54, first step): the spelling of --freeze and its
refusals, a frozen plan's memory map holding exactly the gradient and AdamW bytes of its frozen
blocks less, the search's compact States agreeing with the materialised frozen plans, the
prediction counting no weight-gradient GEMMs, gradient copies or optimizer work for them, and
an unfrozen plan's JSON and hash as before."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.frozen import NOTHING_FROZEN, Frozen, parse_freeze
from dataflow.memplan.plan.memory import grad_bpe, memory_map
from dataflow.memplan.plan.plan import Budget, GradAccum, Plan
from dataflow.memplan.search.build import finish_plan
from dataflow.memplan.search.cost import workload_of
from dataflow.memplan.search.space import Space, State
from dataflow.memplan.plan.chunking import chunking_candidates
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError


def test_parse_freeze_reads_every_spelling():
    """embed, head, layers:A-B, layers:N and layers:all, in any order and combination."""
    f = parse_freeze("embed, head,layers:0-2,layers:5", 8)
    assert f == Frozen(embed=True, head=True, layers=(0, 1, 2, 5))
    assert f.spec() == "embed,head,layers:0-2,layers:5"
    assert parse_freeze("layers:all", 4).layers == (0, 1, 2, 3)
    assert parse_freeze("", 4) is NOTHING_FROZEN and parse_freeze(None, 4) is NOTHING_FROZEN
    assert parse_freeze(f.spec(), 8) == f
    assert f.describe(8) == "embedding, head and 4 of 8 layers (0-2, 5)"


@pytest.mark.parametrize("spec,match", [
    ("embd", "'embd' is not understood; spell embed, head"),
    ("layers:3-1", "runs backwards; write layers:1-3"),
    ("layers:9", "layer 9 is outside 0-7"),
    ("layers:a-b", "'a' is not a layer index"),
])
def test_a_bad_freeze_spec_is_refused_by_name(spec, match):
    """Each bad item is named, with what would work."""
    with pytest.raises(ConfigError, match=match):
        parse_freeze(spec, 8)


def test_make_plan_refuses_a_frozen_layer_beyond_the_model():
    with pytest.raises(ConfigError, match="outside 0-1"):
        make_plan(load_config("tiny"), 64, Budget.from_gib(1, 0.25), get_profile("cpu"),
                  freeze="layers:2")


def _pair(profile, spec: str, model="8b", seqlen=8192, host=80, dev=24):
    cfg = load_config(model)
    plan = make_plan(cfg, seqlen, Budget.from_gib(host, dev), profile)
    d = dataclasses.replace(decisions_of(plan), frozen=parse_freeze(spec, cfg.n_layers))
    return plan, finish_plan(d, Budget.from_gib(host, dev), profile)


def test_frozen_plan_holds_exactly_the_frozen_blocks_state_less():
    """The same decisions with embed, head and layers 0-29 frozen hold, on host and device
    together, exactly the gradient (and, where the optimizer's state lives, m and v) bytes of
    those blocks less, apart from the grad slots no trained layer needs any more."""
    full, frozen = _pair(get_profile("h200"), "embed,head,layers:0-29")
    cfg = full.model
    e = buffers.block_elems(cfg)
    g = grad_bpe(full.grad_accum)

    def untrained(n):  # gradient + m + v, each region aligned as the memory map lays it out
        return buffers.align(n * g) + 2 * buffers.align(n * 2)

    layers_home = [i for i in range(30) if full.layers[i].weights.value == "home"]
    expect_host = sum(untrained(e["layer"]) for _ in layers_home)
    expect_dev = sum(untrained(e["layer"]) for i in range(30) if i not in layers_home)
    for kind, p in (("embed", full.embed), ("head", full.head)):
        if p.weights.value == "home":
            expect_host += untrained(e[kind])
            if kind == "head":  # its gradient's device slot goes too
                expect_dev += buffers.align(e[kind] * g)
        else:
            expect_dev += untrained(e[kind])
    assert full.memory.host_bytes - frozen.memory.host_bytes == expect_host
    assert full.memory.device_bytes - frozen.memory.device_bytes == expect_dev
    names = {n for n, _ in frozen.memory.host} | {n for n, _ in frozen.memory.device}
    assert names == {n for n, _ in full.memory.host}  # categories stay: bytes change


def test_frozen_plan_is_predicted_faster_with_fewer_copies():
    """No gradient D2H of frozen blocks, no AdamW over them, no dW GEMM: fewer bytes each way,
    less compute and a faster step for the same decisions."""
    full, frozen = _pair(get_profile("h200"), "embed,head,layers:0-29")
    a, b = full.prediction, frozen.prediction
    assert b.d2h_bytes < a.d2h_bytes and b.h2d_bytes < a.h2d_bytes
    assert b.compute_s < a.compute_s and b.optimizer_s < a.optimizer_s
    assert b.tok_per_s > a.tok_per_s


def test_unfrozen_plan_json_and_hash_are_unchanged_and_frozen_round_trips():
    full, frozen = _pair(get_profile("h100"), "embed,layers:3")
    assert "frozen" not in full.to_json() and '"frozen"' in frozen.to_json()
    assert full.frozen is NOTHING_FROZEN or full.frozen == NOTHING_FROZEN
    assert Plan.from_json(frozen.to_json()) == frozen and frozen.hash != full.hash
    again = dataclasses.replace(frozen, frozen=NOTHING_FROZEN)
    assert again.to_json() == dataclasses.replace(full, prediction=again.prediction,
                                                  memory=again.memory).to_json()


@pytest.mark.parametrize("model,seqlen", [("tiny", 256), ("small", 2048), ("1b", 512)])
def test_frozen_state_memory_and_work_match_the_materialised_plan(h100, model, seqlen):
    """For random States and random frozen sets, Space.memory equals memory_map and
    Space.workload equals workload_of on the decisions the State materialises to."""
    rng = random.Random(54)
    cfg = load_config(model)
    for ch in chunking_candidates(cfg, seqlen)[:3]:
        for _ in range(6):
            frozen = Frozen(embed=rng.random() < .5, head=rng.random() < .5,
                            layers=tuple(sorted(rng.sample(range(cfg.n_layers),
                                                           rng.randint(0, cfg.n_layers)))))
            sp = Space(cfg, ch, h100, GradAccum.BF16, frozen=frozen)
            N = sp.N
            cuts = sorted(rng.randint(0, N) for _ in range(5))
            counts = tuple(b - a for a, b in zip([0] + cuts, cuts + [N]))
            s = State(resident=rng.randint(0, sp.L), embed_dev=rng.random() < .5,
                      head_dev=rng.random() < .5, opt_streamed=rng.random() < .5,
                      weight_slots=rng.randint(1, 4), grad_slots=rng.randint(1, 3),
                      act_slots=rng.randint(1, 5), acts=counts)
            d = sp.decisions(s, rounds_per_step=2)
            assert d.frozen == frozen
            mm = memory_map(d)
            assert sp.memory(s, 2) == (mm.device_bytes + h100.library_reserve_bytes,
                                       mm.host_bytes), (s, frozen)
            fast, full = sp.workload(s), workload_of(d, h100)
            for f in dataclasses.fields(full):
                assert getattr(fast, f.name) == pytest.approx(getattr(full, f.name),
                                                              rel=1e-12), (f.name, s, frozen)
            assert sp.round_lower_bound_s(s) <= full.compute_s + full.recompute_s + 1e-12


def test_freezing_every_block_is_refused_by_name():
    """Nothing would train: the refusal names the spec and a way out."""
    with pytest.raises(ConfigError, match="freezes every block of model 'tiny', so nothing "
                                          "would train; leave at least one block out"):
        make_plan(load_config("tiny"), 64, Budget.from_gib(1, 0.25), get_profile("cpu"),
                  freeze="embed,head,layers:all")


def test_nothing_frozen_is_falsy_like_an_empty_spec():
    assert not NOTHING_FROZEN and not parse_freeze("", 4) and parse_freeze("head", 4)
