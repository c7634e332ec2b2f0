"""The plan's choice of fused-attention backward (Plan.attention_bwd): the deterministic one (the
default, whose score-sized workspace the plan reserves) or the fast one, whose small workspace
leaves that memory to the rest of the plan. Default plans keep their JSON and hash."""

from __future__ import annotations

import pytest

from dataflow.memplan import make_plan
from dataflow.memplan.plan import buffers
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.plan.plan import AttentionBwd, Budget, Plan
from dataflow.memplan.plan.profiles import get_profile
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

H100 = get_profile("h100")


def _attn_workspace(plan: Plan) -> int:
    from dataflow.memplan.plan.memory import device_regions

    return dict(device_regions(plan))["attn_workspace"]


def test_fast_backward_reserves_the_small_workspace_and_predicts_more_at_tight_budgets():
    cfg = load_config("1b")
    budget = Budget.from_gib(40, 16)
    det = make_plan(cfg, 8192, budget, H100)
    fast = make_plan(cfg, 8192, budget, H100, attention_bwd="fast")
    assert det.attention_bwd is AttentionBwd.DETERMINISTIC and fast.attention_bwd is AttentionBwd.FAST
    t, h, hk, e = 8192, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert _attn_workspace(det) >= 2 * t * t * h + 4 * t * h * e
    assert _attn_workspace(fast) == buffers.attention_workspace_bytes(cfg, t, t, deterministic=False)
    assert _attn_workspace(fast) < 16 * t * hk * e + 4 * t * h * e + (8 << 20)
    # 4 GiB more for the plan at 16 GiB: the prediction rises (more slots, fewer exposed copies)
    assert predict_schedule(fast, H100).tok_per_s > 1.03 * predict_schedule(det, H100).tok_per_s
    assert fast.memory.device_bytes <= budget.device_bytes


def test_split_sequences_use_the_fast_workspace_either_way():
    cfg = load_config("8b")
    a = buffers.attention_workspace_bytes(cfg, 8192, 65536)
    assert a == buffers.attention_workspace_bytes(cfg, 8192, 65536, deterministic=False)


def test_choice_round_trips_and_leaves_default_plans_unchanged():
    cfg = load_config("small")
    budget = Budget.from_gib(2, 1)
    det = make_plan(cfg, 256, budget, get_profile("cpu"))
    fast = make_plan(cfg, 256, budget, get_profile("cpu"), attention_bwd=AttentionBwd.FAST)
    assert "attention_bwd" not in det.to_json()  # omitted at its default: old hashes hold
    assert '"attention_bwd": "fast"' in fast.to_json()
    assert Plan.from_json(fast.to_json()) == fast and Plan.from_json(det.to_json()) == det
    assert fast.hash != det.hash


def test_unknown_choice_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="attention_bwd must be one of.*deterministic.*fast"):
        make_plan(load_config("small"), 256, Budget.from_gib(2, 1), get_profile("cpu"),
                  attention_bwd="quick")


def test_fast_attention_on_a_ring_is_refused_not_ignored(capsys):
    """A ring plans the deterministic backward: --fast-attention with --gpus is an error in
    both CLIs (exit 2, one line naming the flag), not a silently ignored flag."""
    from dataflow.cli.demo import main as demo_main
    from dataflow.cli.plan import main as plan_main

    assert plan_main(["40", "16", "8192", "1b", "--gpus", "2", "--fast-attention"]) == 2
    assert "--fast-attention is not built for --gpus" in capsys.readouterr().err
    assert demo_main(["4", "2", "256", "small", "--gpus", "2", "--fast-attention",
                      "--backend", "numpy"]) == 2
    assert "--fast-attention is not built for --gpus" in capsys.readouterr().err
    out = plan_main(["40", "16", "8192", "1b", "--fast-attention"])
    assert out == 0 and "attention backward fast" in capsys.readouterr().out
