"""LoRA in the FLOP count (docs/flops.md, "LoRA adapters"): model FLOPs, and so MFU, count the
adapters' GEMMs (3 x their forward) and leave out the frozen base's weight-gradient GEMMs, in the
prediction (here) and in a measured step alike (tests/dataflow/test_lora.py); HFU adds the x a^T the backward re-forms for db and the
adapters a recompute re-runs; the count carries its own FLOP-model version."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.lora import (
    RECOMPUTED_TARGETS,
    Lora,
    adapter_model_flops_per_seq,
    parse_lora,
    target_shape,
)
from dataflow.memplan.plan.plan import Plan
from dataflow.memplan.plan.profiles import BUILTIN_PROFILES
from dataflow.memplan.search.build import finish_plan
from dataflow.memplan.search.cost import workload_of
from dataflow.memplan.search.predict import predict_schedule
from dataflow.models.flops import SavedLevel, frozen_flops_per_seq, model_flops_per_seq
from dataflow.models.hf_config import model_config

RECORDS = Path(__file__).resolve().parents[2] / "bench" / "records" / "s27-lora" / "call3"


def _by_hand(cfg, lora: Lora, targets=None) -> int:
    """2 r (in + out) per adapted linear: one layer's adapter forward per token, written out."""
    shapes = {"q": (cfg.model_dim, cfg.q_dim), "k": (cfg.model_dim, cfg.kv_dim),
              "v": (cfg.model_dim, cfg.kv_dim), "o": (cfg.q_dim, cfg.model_dim),
              "gate": (cfg.model_dim, cfg.ffn_dim), "up": (cfg.model_dim, cfg.ffn_dim),
              "down": (cfg.ffn_dim, cfg.model_dim)}
    return sum(2 * lora.rank * sum(shapes[t]) for t in lora.targets
               if targets is None or t in targets)


@pytest.mark.parametrize("rank, targets", [(16, None), (8, "q,v"), (4, "gate,down")])
def test_adapter_model_flops_are_three_times_their_forward_per_layer_and_token(rank, targets):
    """adapter_model_flops_per_seq = 3 L S sum 2 r (in + out), the shapes written out here."""
    cfg, lora = model_config("8b"), parse_lora(rank, None, targets)
    assert adapter_model_flops_per_seq(cfg, lora, 8192) == 3 * 32 * 8192 * _by_hand(cfg, lora)
    assert adapter_model_flops_per_seq(cfg, None, 8192) == 0
    if targets is None:  # docs/flops.md's worked figure
        assert adapter_model_flops_per_seq(cfg, lora, 8192) == pytest.approx(2.0616e12, rel=1e-4)


def test_a_lora_plans_predicted_mfu_counts_the_adapters_and_not_the_frozen_dw():
    """The prediction's model FLOPs of the recorded 8b LoRA plan = the whole model's less the
    frozen base's weight-gradient GEMMs plus the adapters', per sequence of the step."""
    plan = Plan.from_json((RECORDS / "lora-8b-24.plan.json").read_text())
    prof = BUILTIN_PROFILES["h200"]
    plan = finish_plan(decisions_of(plan), plan.budget, prof)
    cfg, ch = plan.model, plan.chunking
    pr = predict_schedule(plan, prof)
    expected = (model_flops_per_seq(cfg, ch.seqlen)
                - frozen_flops_per_seq(cfg, ch.seqlen, cfg.n_layers, True)
                + adapter_model_flops_per_seq(cfg, plan.lora, ch.seqlen)) * ch.seqs_per_step
    assert pr.model_tflop_per_s * 1e12 * pr.step_time_s == pytest.approx(expected, rel=1e-9)
    assert pr.mfu == pytest.approx(expected / pr.step_time_s / prof.peak_bf16_flop_per_s)


def test_a_lora_plans_hfu_adds_the_rebuilt_x_a_and_the_adapters_its_recomputes_rerun():
    """Per round, the hardware FLOPs beyond the model's grow with LoRA by the x a^T the backward
    re-forms for db (none at FULL, whose activation keeps them; below FULL k, v and down,
    whose products no recompute forms) and by the q, o, gate and up adapters of every
    (layer, chunk) saved below FULL."""
    plan = Plan.from_json((RECORDS / "lora-8b-24.plan.json").read_text())
    d = decisions_of(plan)
    cfg, ch, lora, prof = d.model, d.chunking, d.lora, BUILTIN_PROFILES["h200"]
    assert d.segment_layers == 1  # no segment re-runs in this plan: levels alone
    with_lora = workload_of(d, prof).extra_flops
    without = workload_of(dataclasses.replace(d, lora=None), prof).extra_flops
    t = ch.chunk_tokens
    rebuild_below = sum(2 * lora.rank * target_shape(cfg, x)[0] for x in ("k", "v", "down"))
    below_full = sum(a.level is not SavedLevel.FULL for row in d.activations for a in row)
    assert 0 < below_full < cfg.n_layers * ch.chunks_per_round  # both kinds occur
    expected = below_full * t * rebuild_below \
        + below_full * t * _by_hand(cfg, lora, RECOMPUTED_TARGETS)
    assert with_lora - without == pytest.approx(expected, rel=1e-12)
