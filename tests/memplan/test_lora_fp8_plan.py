"""The FP8-stored frozen base in the planner (`--lora-base fp8`, docs/lora.md): a layer block
counted as E4M3 codes and row scales (host, slots, H2D), the lora.base_dequant region, the
dequantisation passes in the cost model, 70b inside 120 GiB of host only with it, and a bf16
base's plan (JSON, hash) unchanged."""

from __future__ import annotations

import pytest

from dataflow.cli import plan as plan_cli
from dataflow.memplan import make_plan
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.lora import Lora, LoraBase, parse_lora, region_sizes
from dataflow.memplan.plan.memory import device_regions, host_regions
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.cost import chunk_costs
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.fp8_layout import FP8_TENSORS, fp8_layer_layout, largest_linear
from dataflow.models.layout import layer_layout

GIB = 1 << 30
H200 = get_profile("h200")


def test_fp8_layer_block_is_one_byte_an_element_plus_four_a_row():
    """8b's fp8 layer block: each linear's codes (1 B/element) and scales (4 B/row), the
    norms in bf16, each aligned: a little over half the bf16 block."""
    cfg = load_config("8b")
    bf, f8 = layer_layout(cfg), fp8_layer_layout(cfg)
    lin = [bf.slot(n) for n in FP8_TENSORS]
    assert sum(t.numel + 4 * t.shape[0] for t in lin) < f8.nbytes
    assert f8.nbytes <= sum(t.numel + 4 * t.shape[0] for t in lin) + 2 * 2 * cfg.model_dim \
        + 256 * 2 * len(bf.tensors)
    assert buffers.block_elems(cfg, parse_lora(16, base="fp8"))["layer"] * 2 == f8.nbytes
    assert buffers.block_elems(cfg, parse_lora(16))["layer"] == bf.numel
    assert 0.5 < f8.nbytes / bf.nbytes < 0.51


def test_fp8_base_plan_holds_less_host_and_a_dequant_region():
    """8b at 64/24: the fp8 base's layer homes are the fp8 block's bytes, less host in all;
    lora.base_dequant holds one bf16 copy of the largest linear; JSON round-trips."""
    cfg = load_config("8b")
    budget = Budget.from_gib(64, 24)
    bf = make_plan(cfg, 8192, budget, H200, lora=parse_lora(16))
    f8 = make_plan(cfg, 8192, budget, H200, lora=dict(rank=16, base="fp8"))
    assert f8.lora.base is LoraBase.FP8 and '"base": "fp8"' in f8.to_json()
    assert Plan.from_json(f8.to_json()) == f8 and f8.hash != bf.hash
    homes = {n: b for n, b in host_regions(f8) if n.startswith("home.layer")}
    assert homes and set(homes.values()) == {buffers.align(fp8_layer_layout(cfg).nbytes)}
    assert f8.memory.host_bytes < bf.memory.host_bytes
    dev = dict(device_regions(f8))
    assert dev["lora.base_dequant"] == buffers.align(2 * largest_linear(cfg))
    assert "lora.base_dequant" not in dict(device_regions(bf))
    assert f8.memory.device_bytes + f8.profile.library_reserve_bytes <= budget.device_bytes


def test_bf16_base_plan_json_and_hash_are_unchanged():
    """base bf16 (the default, or spelt): no 'base' key, the same plan and hash as before."""
    cfg = load_config("tiny")
    budget = Budget(host_bytes=GIB, device_bytes=GIB // 2)
    a = make_plan(cfg, 64, budget, get_profile("cpu"), lora=Lora(rank=4, alpha=8.0,
                                                                 targets=("q", "v")))
    b = make_plan(cfg, 64, budget, get_profile("cpu"),
                  lora=dict(rank=4, alpha=8.0, targets="q,v", base="bf16"))
    assert '"base"' not in a.to_json() and a == b and a.hash == b.hash
    assert region_sizes(cfg, a.lora, 64).keys() == {"lora.weights", "lora.grads", "lora.m",
                                                     "lora.v", "lora.work"}


def test_fp8_base_costs_a_dequant_pass_per_base_gemm():
    """The fp8 base's decode adds time to the forward, the recompute and the frozen backward:
    3 bytes an element of every base linear at HBM rate, per use."""
    cfg = load_config("8b")
    plan = make_plan(cfg, 8192, Budget.from_gib(64, 24), H200, lora=parse_lora(16))
    bf = chunk_costs(cfg, plan.chunking, H200, lora=parse_lora(16))[0]
    f8 = chunk_costs(cfg, plan.chunking, H200, lora=parse_lora(16, base="fp8"))[0]
    elems = sum(layer_layout(cfg).slot(n).numel for n in FP8_TENSORS)
    one_pass = 3 * elems / H200.device_mem_bytes_per_s
    assert f8.fwd_s - bf.fwd_s == pytest.approx(one_pass, rel=0.1)
    assert f8.bwd_frozen_s - bf.bwd_frozen_s == pytest.approx(one_pass, rel=0.1)
    assert 0 < f8.rec_s[1] - bf.rec_s[1] < f8.fwd_s - bf.fwd_s


def test_70b_lora_fits_120_gib_host_with_an_fp8_base_and_not_with_bf16():
    """70b at 8192, r 16, 120/24 GiB on the H200 profile: refused with a bf16 base (it needs
    over 130 GiB of host; the refusal suggests the fp8 base), planned with an fp8 one inside both budgets."""
    cfg = load_config("70b")
    budget = Budget.from_gib(120, 24)
    with pytest.raises(InfeasibleBudget, match="or --lora-base fp8"):  # the way out named
        make_plan(cfg, 8192, budget, H200, lora=parse_lora(16))
    plan = make_plan(cfg, 8192, budget, H200, lora=parse_lora(16, base="fp8"))
    assert plan.memory.host_bytes <= budget.host_bytes
    assert plan.memory.device_bytes + plan.profile.library_reserve_bytes <= budget.device_bytes


def test_dataflow_plan_lora_base_flag(capsys):
    """--lora-base fp8 plans and says so; without --lora-rank it exits 2 naming both; a bad
    storage exits 2 with the spellings; --precision fp8 with LoRA stays refused."""
    assert plan_cli.main(["24", "24", "8192", "8b", "--gpu", "h200", "--lora-rank", "16",
                          "--lora-base", "fp8"]) == 0
    assert "base stored in fp8" in capsys.readouterr().out
    assert plan_cli.main(["24", "24", "8192", "8b", "--gpu", "h200", "--lora-base", "fp8"]) == 2
    assert "--lora-base fp8 needs --lora-rank" in capsys.readouterr().err
    assert plan_cli.main(["24", "24", "8192", "8b", "--lora-rank", "8", "--lora-base",
                          "int4"]) == 2
    assert "spell bf16, fp8" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="FP8 base"):
        make_plan(load_config("tiny"), 64, Budget(host_bytes=GIB, device_bytes=GIB),
                  get_profile("cpu"), lora=parse_lora(4, base="fp8"), precision="fp8")


def test_the_same_decisions_with_an_fp8_base_move_half_the_weight_bytes():
    """8b's 24/24 LoRA plan re-finished with an fp8 base: the step's H2D bytes fall by the
    weight fetches' half (activations and everything else unchanged)."""
    # Imported here: only this test re-finishes a plan's decisions.
    import dataclasses

    from dataflow.memplan.plan.decisions import decisions_of
    from dataflow.memplan.search.build import finish_plan
    from dataflow.memplan.search.predict import predict_schedule

    cfg = load_config("8b")
    budget = Budget.from_gib(64, 24)
    bf = make_plan(cfg, 8192, budget, H200, lora=parse_lora(16))
    f8 = finish_plan(dataclasses.replace(decisions_of(bf), lora=parse_lora(16, base="fp8")),
                     budget, H200)
    streamed = sum(p.weights.value == "home" for p in bf.layers)
    assert streamed > 0
    fetches = streamed * bf.chunking.rounds_per_step * 2  # forward and backward, each round
    saved = fetches * (layer_layout(cfg).nbytes - fp8_layer_layout(cfg).nbytes)
    got = predict_schedule(bf, H200).h2d_bytes - predict_schedule(f8, H200).h2d_bytes
    assert got == pytest.approx(saved, rel=0.05), (got, saved)
