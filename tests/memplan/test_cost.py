"""The cost model: the step is the sum of its parts, copies and recompute are counted where the
plan puts them, and the FLOP model is the shared one (dataflow.models.flops)."""

import dataclasses

import pytest

from dataflow.memplan.search.cost import predict, rounds_for_target
from dataflow.memplan.plan.plan import Where
from dataflow.models.flops import FLOP_MODEL_VERSION, SavedLevel, model_flops_per_seq

from .forced import HOME_HOST, HOME_STREAMED, RESIDENT, acts, forced


def _parts(pr):
    return (pr.compute_s + pr.recompute_s + pr.exposed_h2d_s + pr.exposed_d2h_s + pr.optimizer_s)


def test_all_resident_plan_moves_nothing_and_is_compute_plus_optimizer(h100):
    """Everything on the device: no PCIe bytes, no exposed copies, no recompute."""
    pr = forced(h100, "small", 512, chunk_tokens=512, rounds=64).prediction
    assert pr.h2d_bytes == 0 and pr.d2h_bytes == 0
    assert pr.exposed_h2d_s == 0 and pr.exposed_d2h_s == 0 and pr.recompute_s == 0
    assert pr.step_time_s == pytest.approx(_parts(pr))
    assert pr.hfu >= pr.mfu > 0 and pr.bottleneck == "compute"


def test_mfu_uses_the_shared_flop_model(h100):
    """MFU = model FLOPs per sequence (dataflow.models.flops) x sequences / step / peak."""
    plan = forced(h100, "small", 256, chunk_tokens=512, rounds=2)
    pr, ch = plan.prediction, plan.chunking
    flops = model_flops_per_seq(plan.model, 256) * ch.seqs_per_step
    assert pr.mfu == pytest.approx(flops / pr.step_time_s / h100.peak_bf16_flop_per_s)
    assert pr.tok_per_s == pytest.approx(ch.tokens_per_step / pr.step_time_s)
    assert FLOP_MODEL_VERSION


def test_streamed_weights_cross_pcie_each_round_unless_held_in_a_slot(h100):
    """Round 0 loads every streamed layer in forward and all but the held ones in backward;
    later rounds also find the first `weight_slots` layers still in their slots."""
    kw = dict(model="small", seqlen=256, chunk_tokens=256, layers=(HOME_HOST,) * 4, grad_slots=1)
    one = forced(h100, weight_slots=1, rounds=1, **kw).prediction
    layer_b = 2 * forced(h100, **kw, weight_slots=1).model.layer_params  # ~ block bytes
    assert one.h2d_bytes >= (4 + 3) * layer_b
    two_rounds = forced(h100, weight_slots=1, rounds=2, **kw).prediction
    four_slots = forced(h100, weight_slots=4, rounds=2, **kw).prediction
    assert four_slots.h2d_bytes < two_rounds.h2d_bytes


def test_one_weight_slot_exposes_more_copy_time_than_two(h100):
    """With one slot a layer's load cannot overlap the previous layer's compute."""
    kw = dict(model="small", seqlen=256, chunk_tokens=256, layers=(HOME_HOST,) * 4, grad_slots=2)
    one = forced(h100, weight_slots=1, **kw).prediction
    two = forced(h100, weight_slots=2, **kw).prediction
    assert one.exposed_h2d_s > two.exposed_h2d_s
    assert one.step_time_s == pytest.approx(_parts(one))


def test_home_activations_cost_pcie_and_lower_levels_cost_recompute(h100):
    """FULL at home moves more bytes than INP_ATTN at home; INP_ATTN recomputes more."""
    def plan(level, home):
        return forced(h100, "small", 512, chunk_tokens=256, chunks_per_round=2,
                      activations=acts(4, 2, level, home), act_slots=2).prediction
    full_home, attn_home = plan(SavedLevel.FULL, Where.HOME), plan(SavedLevel.INP_ATTN, Where.HOME)
    only_dev = plan(SavedLevel.INP_ONLY, Where.DEVICE)
    full_dev = plan(SavedLevel.FULL, Where.DEVICE)
    assert full_home.h2d_bytes > attn_home.h2d_bytes > 0 and full_dev.h2d_bytes == 0
    assert attn_home.recompute_s > full_home.recompute_s == 0
    assert only_dev.recompute_s > attn_home.recompute_s
    assert only_dev.hfu > only_dev.mfu


def test_grads_at_home_skip_the_fetch_in_the_first_round(h100):
    """Round 0 starts gradient sums from zero; later rounds fetch the running sum."""
    kw = dict(model="small", seqlen=256, chunk_tokens=256, layers=(HOME_HOST,) * 4,
              weight_slots=4, grad_slots=1)
    r1, r2 = forced(h100, rounds=1, **kw).prediction, forced(h100, rounds=2, **kw).prediction
    assert r2.d2h_bytes == 2 * r1.d2h_bytes
    assert r2.h2d_bytes > r1.h2d_bytes


def test_optimizer_location_changes_where_its_time_goes(h100):
    """Streamed AdamW moves p, g, m, v over PCIe; host AdamW moves nothing."""
    kw = dict(model="small", seqlen=256, chunk_tokens=256, weight_slots=2, grad_slots=2)
    host = forced(h100, layers=(HOME_HOST,) * 4, **kw).prediction
    strm = forced(h100, layers=(HOME_STREAMED,) * 4, opt_stage_elems=4096, **kw).prediction
    dev = forced(h100, **{**kw, "weight_slots": 0, "grad_slots": 0}).prediction
    assert strm.h2d_bytes > host.h2d_bytes and strm.optimizer_s > 0
    assert dev.optimizer_s < host.optimizer_s


def test_rounds_for_target_keeps_the_optimizer_share_below_target():
    """The fewest rounds whose optimizer share is at most the target."""
    r = rounds_for_target(1.0, 1.0, 1.0, 0.02)
    assert 1.0 / (r + 1.0) <= 0.02 < 1.0 / (r - 1 + 1.0)
    assert rounds_for_target(1.0, 1.0, 0.0, 0.02) == 1


def test_faster_pcie_never_predicts_a_slower_step(h100):
    """Raising copy rates only shortens exposed copy time."""
    plan = forced(h100, "small", 256, chunk_tokens=256, layers=(HOME_HOST,) * 4, weight_slots=2,
                  grad_slots=1, activations=acts(4, 1, SavedLevel.FULL, Where.HOME), act_slots=1)
    fast = dataclasses.replace(h100, h2d_bytes_per_s=4 * h100.h2d_bytes_per_s,
                               d2h_bytes_per_s=4 * h100.d2h_bytes_per_s,
                               h2d_duplex_bytes_per_s=4 * h100.h2d_duplex_bytes_per_s,
                               d2h_duplex_bytes_per_s=4 * h100.d2h_duplex_bytes_per_s)
    assert predict(plan, fast).step_time_s < plan.prediction.step_time_s


def test_random_forced_plans_predict_consistent_steps(prng, h100):
    """For random decisions on small: the step is the sum of its parts, every part is
    non-negative, HFU >= MFU, and bytes moved are zero exactly when nothing lives at home."""
    from dataflow.memplan.plan.plan import GradAccum, SavedActivation

    for _ in range(40):
        placements = [prng.choice([RESIDENT, HOME_HOST, HOME_STREAMED]) for _ in range(4)]
        cpr = prng.choice([1, 2, 4])
        a = [[SavedActivation(level=prng.choice(list(SavedLevel)),
                              home=prng.choice(list(Where))) for _ in range(cpr)]
             for _ in range(4)]
        embed, head = prng.choice([RESIDENT, HOME_HOST]), prng.choice([RESIDENT, HOME_STREAMED])
        plan = forced(h100, "small", 256, chunk_tokens=prng.choice([256, 512]),
                      chunks_per_round=cpr, rounds=prng.randint(1, 5), layers=tuple(placements),
                      activations=a, embed=embed, head=head, weight_slots=prng.randint(1, 5),
                      grad_slots=prng.randint(1, 3), act_slots=prng.randint(1, 6),
                      opt_stage_elems=prng.choice([256, 65536]),
                      grad_accum=prng.choice(list(GradAccum)))
        pr = plan.prediction
        assert pr.step_time_s == pytest.approx(_parts(pr), rel=1e-9)
        assert min(pr.exposed_h2d_s, pr.exposed_d2h_s, pr.recompute_s, pr.optimizer_s) >= 0
        assert pr.hfu >= pr.mfu
        moves = (any(p.weights is Where.HOME for p in (*placements, embed, head))
                 or any(x.home is Where.HOME for row in a for x in row))
        assert (pr.h2d_bytes + pr.d2h_bytes > 0) == moves


def test_routed_experts_cost_their_small_gemm_rate_or_their_launches(h100):
    """expert_cost.expert_extra_seconds: nothing for a dense model; for OLMoE's experts the time
    beyond the dense rate is the small-GEMM rate's (rows / (rows + EXPERT_GEMM_HALF_ROWS)) plus one
    offsets wait, the backward's twice the forward's GEMM part; at a chunk so small that the
    launches take longer than the GEMMs, the launches are the time."""
    from dataflow.memplan.search import cost, expert_cost
    from dataflow.models.hf_config import model_config

    assert expert_cost.expert_extra_seconds(model_config("1b"), h100, 8192) == (0.0, 0.0)
    cfg = model_config("olmoe-1b-7b")
    m = cfg.moe
    t = 16384
    rows = t * m.top_k / m.n_experts
    dense = cost.gemm_flop_per_s(cfg, h100, t)
    flops = 2.0 * t * m.top_k * cfg.model_dim * 3 * m.expert_ffn_dim
    assert dense == cost.gemm_flop_per_s(cfg, h100, cost.GEMM_REF_TOKENS)  # at the cap
    gemm_extra = flops / dense * expert_cost.EXPERT_GEMM_HALF_ROWS / rows  # 1/slow - 1/dense
    assert expert_cost.expert_path(cfg, h100, t) == "loop"  # olmoe's 2,048 rows an expert
    fwd, bwd = expert_cost.expert_extra_seconds(cfg, h100, t)
    assert fwd == pytest.approx(gemm_extra + expert_cost.EXPERT_SYNC_S)
    assert bwd == pytest.approx(2 * gemm_extra + expert_cost.EXPERT_SYNC_S)
    # 64 tokens: 8 rows an expert, every expert active; the launches bind (the rows factor
    # is not applied on top of the dense rate's own small-token factor)
    t = 64
    fwd, _ = expert_cost.expert_extra_seconds(cfg, h100, t, path="loop")
    launches = expert_cost.EXPERT_CALLS_FWD * m.n_experts * expert_cost.EXPERT_GEMM_HOST_S
    dense_s = 2.0 * t * m.top_k * cfg.model_dim * 3 * m.expert_ffn_dim / \
        cost.gemm_flop_per_s(cfg, h100, t)
    assert fwd == pytest.approx(launches - dense_s + expert_cost.EXPERT_SYNC_S)


def test_expert_path_is_grouped_where_the_loop_is_launch_bound_and_the_shapes_fit(h100):
    """expert_cost.expert_path: the loop for olmoe-1b-7b's 64 experts at 8k and 16k-token chunks
    (its GEMMs outrun the grouped kernels), grouped for qwen3-30b-a3b's 128 small experts at 8k (the
    loop's launches bind) and for olmoe at 2k; never for a dense model or shapes the grouped
    kernels do not take; the grouped path is charged its rate alone (no launches, no wait)."""
    import dataclasses

    from dataflow.memplan.search import cost, expert_cost
    from dataflow.models.hf_config import model_config

    olmoe, qwen = model_config("olmoe-1b-7b"), model_config("qwen3-30b-a3b")
    assert expert_cost.expert_path(olmoe, h100, 8192) == "loop"
    assert expert_cost.expert_path(olmoe, h100, 16384) == "loop"
    assert expert_cost.expert_path(olmoe, h100, 2048) == "grouped"
    assert expert_cost.expert_path(qwen, h100, 8192) == "grouped"
    assert expert_cost.expert_path(model_config("1b"), h100, 8192) == "loop"
    odd = dataclasses.replace(qwen, moe=dataclasses.replace(qwen.moe, expert_ffn_dim=704))
    assert expert_cost.expert_path(odd, h100, 8192) == "loop"
    m, t = qwen.moe, 8192
    flops = 2.0 * t * m.top_k * qwen.model_dim * 3 * m.expert_ffn_dim
    ref = cost.gemm_flop_per_s(qwen, h100, cost.GEMM_REF_TOKENS)
    dense_s = flops / cost.gemm_flop_per_s(qwen, h100, t)
    fwd, bwd = expert_cost.expert_extra_seconds(qwen, h100, t)
    assert fwd == pytest.approx(flops / (ref * expert_cost.EXPERT_GROUPED_DENSE_FRACTION) - dense_s)
    assert bwd == pytest.approx(2 * (fwd + dense_s) - 2 * dense_s)
