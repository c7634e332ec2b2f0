"""Plan.precision (issue 53): an FP8 plan holds exactly the FP8 operand scratch beyond the bf16
plan of the same decisions, names its precision in its JSON (a bf16 plan's JSON and hash are as
before), is predicted at the profile's measured FP8 rate (faster where it is twice bf16's) or at
the bf16 rate with the quantise passes added (slower: no speedup claimed) where none is
measured; a bad precision is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.memplan import get_profile, make_plan, predict_schedule
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import Budget, Plan, Precision
from dataflow.memplan.plan.profiles import BUILTIN_PROFILES
from dataflow.memplan.search.build import finish_plan
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError


def _plans(profile):
    cfg = load_config("8b")
    bf16 = make_plan(cfg, 8192, Budget.from_gib(80, 24), profile)
    d = dataclasses.replace(decisions_of(bf16), precision=Precision.FP8)
    return bf16, finish_plan(d, Budget.from_gib(80, 24), profile)


def test_an_fp8_plan_holds_exactly_its_operand_scratch_more():
    bf16, fp8 = _plans(get_profile("h100"))
    cfg, t = bf16.model, bf16.chunking.chunk_tokens
    extra = buffers.packed_bytes(buffers.chunk_workspace_specs(cfg, t, Precision.FP8)) \
        - buffers.packed_bytes(buffers.chunk_workspace_specs(cfg, t))
    a, b = buffers.fp8_scratch_specs(cfg, t)[:2]
    assert a.shape == (t * cfg.ffn_dim,) and b.shape == (max(cfg.ffn_dim * cfg.model_dim,
                                                               t * cfg.ffn_dim),)
    assert fp8.memory.device_bytes - bf16.memory.device_bytes == extra >= a.shape[0] + b.shape[0]


def test_json_names_fp8_and_leaves_bf16_as_it_was():
    bf16, fp8 = _plans(get_profile("h100"))
    assert "precision" not in bf16.to_json() and '"precision": "fp8"' in fp8.to_json()
    assert Plan.from_json(fp8.to_json()) == fp8 and fp8.hash != bf16.hash
    assert Plan.from_json(bf16.to_json()).precision is Precision.BF16


def test_fp8_is_predicted_faster_only_at_a_measured_rate():
    h100 = dataclasses.replace(get_profile("h100"), fp8_gemm_flop_per_s=None)
    bf16, fp8 = _plans(h100)
    assert fp8.prediction.tok_per_s < bf16.prediction.tok_per_s  # quantise passes, no rate
    measured = dataclasses.replace(h100, fp8_gemm_flop_per_s=2 * h100.peak_bf16_flop_per_s
                                   * h100.gemm_efficiency)
    bf16m, fp8m = _plans(measured)
    assert bf16m.prediction.tok_per_s == bf16.prediction.tok_per_s
    assert fp8m.prediction.tok_per_s > 1.1 * bf16m.prediction.tok_per_s


def test_the_built_in_h100_and_h200_profiles_carry_their_measured_fp8_rates():
    for name in ("h100", "h200"):
        p = BUILTIN_PROFILES[name]
        assert 1.8 < p.fp8_gemm_flop_per_s / (p.peak_bf16_flop_per_s * p.gemm_efficiency) < 1.9


def test_a_bad_precision_is_refused_by_name():
    with pytest.raises(ConfigError, match="precision must be one of"):
        make_plan(load_config("tiny"), 64, Budget.from_gib(1, 0.25), get_profile("cpu"),
                  precision="fp16")


def test_dataflow_plan_plans_a_ring_in_fp8_against_one_fp8_device(capsys, monkeypatch):
    """--gpus N --precision fp8: every rank's plan is fp8, and the speedups compare with one
    device in fp8 too (not with bf16, which would flatter the ring). The table over 2..64 GPUs
    is cut to 2 (most of this test's 30 s on CI's CPU; nothing here reads the larger counts)."""
    import json

    from dataflow.cli import plan as plan_cli  # (the CLI: only this test needs it)

    monkeypatch.setattr(plan_cli, "GPU_COUNTS", (2,))

    base = ["80", "24", "8192", "8b", "--gpu", "h200", "--gpus", "2", "--json"]
    assert plan_cli.main(base + ["--precision", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert all(r["plan"]["precision"] == "fp8" for r in fp8["ranks"])
    one = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), get_profile("h200"),
                    precision="fp8")
    # the one device as its compiled schedule predicts it (memplan.search.layout_final)
    assert fp8["single_tok_per_s"] == pytest.approx(predict_schedule(one, one.profile).tok_per_s)
