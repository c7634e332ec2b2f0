"""LoRA in the planner: the spelling and its refusals, the plan's JSON and hash unchanged
without LoRA, the adapters' regions in the memory map (and the search's budget), their cost."""

from __future__ import annotations

import pytest

from dataflow.cli import plan as plan_cli
from dataflow.memplan import make_plan
from dataflow.memplan.plan.lora import (ADAPTER_BPE, Lora, adapter_params, parse_lora,
                                        region_sizes)
from dataflow.memplan.plan.memory import device_regions
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.cost import chunk_costs
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

GIB = 1 << 30


def test_parse_lora_defaults_and_order():
    """alpha defaults to the rank, targets to all seven, in the canonical order."""
    lo = parse_lora(8)
    assert lo.alpha == 8.0 and lo.scale == 1.0
    assert lo.targets == ("q", "k", "v", "o", "gate", "up", "down")
    assert parse_lora(4, 16, "down,q").targets == ("q", "down")
    assert parse_lora(None) is None


@pytest.mark.parametrize("args,match", [((8, None, "q,x"), "'x' is not a target"),
                                        ((0,), "positive integer"),
                                        ((4, -1.0), "positive number"),
                                        ((None, 8.0), "need --lora-rank")])
def test_parse_lora_refuses_bad_values_by_name(args, match):
    """A bad rank, alpha or target is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=match):
        parse_lora(*args)


def test_adapter_count_of_8b_rank_16():
    """8b, r 16, all seven: 16 x (4096*4 + 1024*2 + ... ) per layer, 32 layers."""
    cfg = load_config("8b")
    per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert adapter_params(cfg, parse_lora(16)) == per_layer * 32 == 41_943_040


def test_plan_without_lora_keeps_its_json_and_hash():
    """No LoRA: no 'lora' key in the JSON; a LoRA plan round-trips through JSON."""
    cfg = load_config("tiny")
    budget = Budget(host_bytes=GIB, device_bytes=GIB // 2)
    plain = make_plan(cfg, 64, budget, get_profile("cpu"))
    assert '"lora"' not in plain.to_json()
    lo = make_plan(cfg, 64, budget, get_profile("cpu"), lora=Lora(rank=4, alpha=8.0,
                                                                  targets=("q", "v")))
    assert Plan.from_json(lo.to_json()) == lo and lo.hash != plain.hash
    assert lo.frozen.embed and lo.frozen.head and len(lo.frozen.layers) == cfg.n_layers


def test_lora_regions_are_in_the_memory_map_and_the_budget():
    """The five lora.* device regions hold 18 bytes per adapter parameter plus the (T, r) bf16
    intermediates (u and one per target), and a plan with them still fits its device budget."""
    cfg = load_config("tiny")
    lo = parse_lora(4)
    budget = Budget(host_bytes=GIB, device_bytes=GIB // 2)
    plan = make_plan(cfg, 64, budget, get_profile("cpu"), lora=lo)
    regions = dict(device_regions(plan))
    sizes = region_sizes(cfg, lo, plan.chunking.chunk_tokens)
    assert set(sizes) <= set(regions)
    n = adapter_params(cfg, lo)
    products = 1 + len(lo.targets)  # u, then each target's s (x a^T)
    assert sum(sizes.values()) == n * ADAPTER_BPE + 2 * products * plan.chunking.chunk_tokens * 4
    assert plan.memory.device_bytes + plan.profile.library_reserve_bytes <= budget.device_bytes


def test_lora_costs_time_on_forward_recompute_and_backward():
    """Adapters add seconds to the forward, the recompute and the frozen backward."""
    cfg = load_config("8b")
    plan = make_plan(cfg, 8192, Budget.from_gib(64, 24), get_profile("h200"), lora=parse_lora(16))
    base = chunk_costs(cfg, plan.chunking, plan.profile)[0]
    with_lora = chunk_costs(cfg, plan.chunking, plan.profile, lora=plan.lora)[0]
    assert with_lora.fwd_s > base.fwd_s and with_lora.bwd_frozen_s > base.bwd_frozen_s
    assert with_lora.rec_s[1] > base.rec_s[1]
    assert with_lora.fwd_s < 1.1 * base.fwd_s  # rank 16: a few percent


def test_lora_refuses_moe_and_partial_freeze():
    """An MoE model and a --freeze of part of the base are refused by name."""
    budget = Budget.from_gib(512, 80)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        make_plan(load_config("olmoe-1b-7b"), 4096, budget, get_profile("h200"),
                  lora=parse_lora(8))
    with pytest.raises(ConfigError, match="drop --freeze"):
        make_plan(load_config("tiny"), 64, budget, get_profile("cpu"), lora=parse_lora(8),
                  freeze="layers:0")


def test_dataflow_plan_8b_lora_fits_24_24(capsys):
    """dataflow-plan 24 24 8192 8b --gpu h200 --lora-rank 16 plans (full fine-tuning does not)."""
    assert plan_cli.main(["24", "24", "8192", "8b", "--gpu", "h200", "--lora-rank", "16",
                          "--lora-targets", "q,k,v,o,gate,up,down"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 16" in out
    assert plan_cli.main(["24", "24", "8192", "8b", "--gpu", "h200", "--lora-rank", "4",
                          "--lora-targets", "q,zz"]) == 2
    assert "'zz'" in capsys.readouterr().err
