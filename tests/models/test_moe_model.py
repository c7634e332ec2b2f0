"""Mixture-of-experts models (issue 41, step 2): ModelConfig.moe for the olmoe and qwen3_moe
families, the layer layout with the router and one contiguous range per expert, total and
active parameter and FLOP counts, and training on the reference trainer against a float64
transcription of transformers' OlmoeForCausalLM / Qwen3MoeForCausalLM (mean cross-entropy
plus router_aux_loss_coef * load-balancing loss, plus a z-loss where the config has one). The
planner and dataflow-plan plan an MoE config for one device and refuse a ring by name (the engine
on NumPy: tests/dataflow/test_engine_moe.py); HF import and export: tests/models/test_hf_moe.py."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import make_plan
from dataflow.cli.plan import main as plan_main
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import MoE, ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.flops import (FLOP_MODEL_VERSION, MOE_FLOP_MODEL_VERSION, SavedLevel,
                                   flop_model_version, layer_matmul_flops,
                                   level_recompute_flops, model_flops_per_seq)
from dataflow.models.init import BF16, init_model
from dataflow.models.layout import ROUTER_TENSOR, expert_names, layer_layout
from dataflow.models.serial import from_json, to_json
from dataflow.reference_model import forward_backward
from dataflow.reference_trainer import ReferenceTrainer
from tests.llama_float64 import llama_loss_float64
from tests.moe_model_float64 import moe_causal_lm_loss_float64
from tests.numeric import central_difference

BASE = dict(vocab_size=61, model_dim=32, head_dim=8, n_layers=2, n_heads=4, n_kv_heads=2,
            ffn_dim=24, rope_theta=1e4, norm_eps=1e-6, qk_norm=True)
QWEN3_MOE = ModelConfig(name="qwen3-moe-odd", family="qwen3_moe", **BASE, moe=MoE(
    n_experts=6, top_k=2, expert_ffn_dim=12, norm_topk_prob=True, router_aux_loss_coef=0.3,
    router_z_loss_coef=0.02))
OLMOE = ModelConfig(name="olmoe-odd", family="olmoe", **BASE, moe=MoE(
    n_experts=5, top_k=2, expert_ffn_dim=16, norm_topk_prob=False, router_aux_loss_coef=0.2))
SHARED = dataclasses.replace(QWEN3_MOE, name="shared-odd", moe=dataclasses.replace(
    QWEN3_MOE.moe, n_shared_experts=1))
"""A shared expert (DeepSeek-V3's kind) on Qwen3-MoE's attention: no released family has one
here; it checks the layout and the reference's ungated shared path."""
CONFIGS = {"qwen3_moe": QWEN3_MOE, "olmoe": OLMOE, "shared": SHARED}
FD_STEP = 1e-5


def _f64_weights(cfg, rng):
    """A seeded init in float64 with every norm weight 1 + 0.2 N(0, 1) (generic gradients) and
    the routers scaled up 4x, so routing is decided by clear margins."""
    w = init_model(cfg, int(rng.integers(0, 2**31)))
    out = types.SimpleNamespace(embed=w.embed.astype(np.float64),
                                layers=[b.astype(np.float64) for b in w.layers],
                                head=w.head.astype(np.float64))
    lay = layer_layout(cfg)
    for block in out.layers:
        for t in lay.tensors:
            if t.name.endswith("_norm") or t.name.endswith("layernorm"):
                lay.view(block, t.name)[...] = 1.0 + 0.2 * rng.standard_normal(t.shape)
        lay.view(block, ROUTER_TENSOR)[...] *= 4.0
    return out


def _objective(cfg, w, batch):
    return moe_causal_lm_loss_float64(cfg, w, batch)[0]


def _directional_difference(cfg, w, batch, blocks, dirs, h: float) -> float:
    """The objective's central difference along `dirs` (one array per block) at step h; the
    blocks are put back by the same additions undone (to within their rounding)."""
    for b, d in zip(blocks, dirs):
        b += h * d
    up = _objective(cfg, w, batch)
    for b, d in zip(blocks, dirs):
        b -= 2 * h * d
    down = _objective(cfg, w, batch)
    for b, d in zip(blocks, dirs):
        b += h * d
    return (up - down) / (2 * h)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_reference_trainer_is_the_float64_transcription_loss_aux_and_gradients(family, rng):
    """float64: the reference trainer's mean loss is the transcription's cross-entropy (1e-10),
    its auxiliary losses are load_balancing_loss_func's and router_z_loss_func's over every
    layer of the whole batch (1e-10), and its gradient of the objective equals central
    differences of the transcription's objective along two random directions over every block
    and at single router, expert and QK-norm coordinates (1e-6 of the gradient's scale)."""
    cfg = CONFIGS[family]
    w = _f64_weights(cfg, rng)
    batch = rng.integers(0, cfg.vocab_size, (2, 9))
    tr = ReferenceTrainer(cfg, w, lr=1e-3, grad_accum_dtype=np.float64)
    loss, n_tokens, grads = tr.accumulate_grads(batch)
    objective, lm, aux, z = moe_causal_lm_loss_float64(cfg, w, batch)
    assert n_tokens == 16
    assert abs(loss - lm) <= 1e-10 * abs(lm)
    assert abs(tr.last_router.aux_loss - aux) <= 1e-10 * aux
    assert abs(tr.last_router.z_loss - z) <= 1e-10 * z
    assert tr.last_router.rows == 2 * 8 * cfg.n_layers
    blocks = tr.blocks
    scale = max(float(np.max(np.abs(g))) for g in grads)
    checked = 0
    for _ in range(8):  # two smooth directions wanted; a few may cross a routing flip
        dirs = [rng.standard_normal(b.shape) for b in blocks]
        want = sum(float(np.dot(g, d)) for g, d in zip(grads, dirs))
        fd, fd_half = (_directional_difference(cfg, w, batch, blocks, dirs, h)
                       for h in (FD_STEP, FD_STEP / 2))
        if abs(fd - fd_half) > 1e-7 * max(abs(fd), 1.0):
            # A top-k choice flips within the step (the objective jumps there): the central
            # difference then scales as 1 / step, and the gradient is not what it measures.
            continue
        assert abs(fd - want) <= 1e-6 * max(abs(want), 1.0), (fd, want)
        checked += 1
        if checked == 2:
            break
    assert checked == 2, "the directions crossed routing flips; the routers' margins are too small"
    lay = layer_layout(cfg)
    names = [ROUTER_TENSOR, *expert_names(1), "self_attn.q_norm", "self_attn.k_norm"]
    if cfg.moe.n_shared_experts:
        names += list(expert_names(0, shared=True))
    for layer in range(cfg.n_layers):
        for name in names:
            view = lay.view(w.layers[layer], name).reshape(-1)
            g = lay.view(grads[1 + layer], name).reshape(-1)
            j = int(np.argmax(np.abs(g)))  # the largest coordinate: never an idle expert's zero
            fd = central_difference(lambda: _objective(cfg, w, batch), view, j, FD_STEP)
            assert abs(fd - g[j]) <= 1e-6 * max(abs(g[j]), scale), (layer, name, fd, g[j])


def test_reference_trainer_micro_batches_average_their_auxiliary_losses(rng):
    """float64, micro_batches 2 (the engine's rounds): the trainer's aux and z are the mean of
    the transcription's per half of the batch (1e-10), its loss the whole batch's mean
    cross-entropy, and its gradient that of lm + coef x mean(aux_r) + z_coef x mean(z_r) along
    two random directions (central differences, 1e-6; a direction whose step flips a token's
    top-k, where the objective jumps, is drawn again); the halves' mean differs from the whole
    batch's aux, which micro_batches 1 keeps. A batch that does not split is refused."""
    cfg = QWEN3_MOE
    w = _f64_weights(cfg, rng)
    batch = rng.integers(0, cfg.vocab_size, (4, 7))
    halves = (batch[:2], batch[2:])

    def objective():
        parts = [moe_causal_lm_loss_float64(cfg, w, b) for b in halves]
        return float(np.mean([p[0] for p in parts]))  # equal targets: the LM means average too

    tr = ReferenceTrainer(cfg, w, lr=1e-3, grad_accum_dtype=np.float64, micro_batches=2)
    loss, _, grads = tr.accumulate_grads(batch)
    parts = [moe_causal_lm_loss_float64(cfg, w, b) for b in halves]
    _, lm, aux_whole, _ = moe_causal_lm_loss_float64(cfg, w, batch)
    assert abs(loss - lm) <= 1e-10 * lm and tr.last_router is None
    for router, (_, _, aux, z) in zip(tr.last_routers, parts):
        assert abs(router.aux_loss - aux) <= 1e-10 * aux and abs(router.z_loss - z) <= 1e-10 * z
    assert abs(aux_whole - np.mean([p[2] for p in parts])) > 1e-6
    def along(dirs, step):
        for b, d in zip(tr.blocks, dirs):
            b += step * d
        up = objective()
        for b, d in zip(tr.blocks, dirs):
            b -= 2 * step * d
        down = objective()
        for b, d in zip(tr.blocks, dirs):
            b += step * d
        return (up - down) / (2 * step)

    checked = 0
    for _ in range(6):  # two directions whose +-step keeps every token's top-k
        dirs = [rng.standard_normal(b.shape) for b in tr.blocks]
        want = sum(float(np.dot(g, d)) for g, d in zip(grads, dirs))
        fd, fd_half = along(dirs, FD_STEP), along(dirs, FD_STEP / 2)
        if abs(fd - fd_half) > 1e-6 * max(abs(fd_half), 1.0):
            continue  # a routing flip inside the step: the objective jumps, no derivative
        assert abs(fd - want) <= 1e-6 * max(abs(want), 1.0), (fd, want)
        checked += 1
        if checked == 2:
            break
    assert checked == 2, "every direction crossed a routing flip"
    with pytest.raises(ConfigError, match="does not split into 2 equal micro-batches"):
        tr.accumulate_grads(batch[:3])


def test_olmoe_qk_norm_runs_over_the_whole_projection():
    """OLMoE's q_norm and k_norm weights are (q_dim,) and (kv_dim,) (OlmoeRMSNorm over the
    whole projection), Qwen3-MoE's (head_dim,); the layer counts include them."""
    lay = layer_layout(OLMOE)
    assert lay.slot("self_attn.q_norm").shape == (OLMOE.q_dim,)
    assert lay.slot("self_attn.k_norm").shape == (OLMOE.kv_dim,)
    assert layer_layout(QWEN3_MOE).slot("self_attn.k_norm").shape == (QWEN3_MOE.head_dim,)
    for cfg in CONFIGS.values():
        assert sum(t.numel for t in layer_layout(cfg).tensors) == cfg.layer_params


def test_a_batch_where_some_experts_get_no_token(rng):
    """k 1 of 8 experts and 3 tokens: at least 5 experts of every layer get no token; their
    gradients are exact zeros, the loss still equals the transcription's, and AdamW (which
    updates every block) still decays an idle expert's weights by weight decay."""
    cfg = dataclasses.replace(QWEN3_MOE, moe=dataclasses.replace(
        QWEN3_MOE.moe, n_experts=8, top_k=1))
    w = _f64_weights(cfg, rng)
    batch = rng.integers(0, cfg.vocab_size, (1, 4))
    _, lm, _, _ = moe_causal_lm_loss_float64(cfg, w, batch)
    loss, n, grads = forward_backward(cfg, w, batch[0], 1.0 / 3)
    assert abs(loss / n - lm) <= 1e-10 * lm
    lay = layer_layout(cfg)
    assert int(grads.router.counts.sum()) == 3 * cfg.n_layers
    idle_total = 0
    for layer in range(cfg.n_layers):
        dw = lay.views(grads.layers[layer])
        for e in range(8):
            hit = any(np.any(dw[n]) for n in expert_names(e))
            idle_total += not hit
            if not hit:
                before = lay.view(w.layers[layer], expert_names(e)[0]).copy()
                idle = (layer, e)
        assert sum(not any(np.any(dw[n]) for n in expert_names(e)) for e in range(8)) >= 5
    assert idle_total >= 10
    tr = ReferenceTrainer(cfg, w, lr=1e-2, weight_decay=0.1)
    tr.train_step(batch)
    after = lay.view(w.layers[idle[0]], expert_names(idle[1])[0])
    np.testing.assert_allclose(after, before * (1 - 1e-2 * 0.1), rtol=1e-14)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_reference_trainer_takes_adamw_steps_on_the_objective(family, rng):
    """Three AdamW steps in float64: each step's reported loss is the transcription's
    cross-entropy at the weights it starts from (not the objective), its aux_loss the
    transcription's, and the weights move as a plain AdamW (torch's formula, decoupled decay)
    on the gradient of mean CE + coef * aux (+ z) does; the objective goes down. A bf16 trainer
    (the engine's storage) follows the same losses within bf16 rounding."""
    cfg = CONFIGS[family]
    w = _f64_weights(cfg, rng)
    w16 = types.SimpleNamespace(embed=w.embed.astype(BF16), layers=[b.astype(BF16) for b in
                                                                    w.layers],
                                head=w.head.astype(BF16))
    batch = rng.integers(0, cfg.vocab_size, (2, 9))
    lr, b1, b2, eps, wd = 3e-3, 0.9, 0.95, 1e-8, 0.01
    tr = ReferenceTrainer(cfg, w, lr=lr, betas=(b1, b2), weight_decay=wd,
                          grad_accum_dtype=np.float64)
    tr16 = ReferenceTrainer(cfg, w16, lr=lr, betas=(b1, b2), weight_decay=wd)
    m = [np.zeros_like(b) for b in tr.blocks]
    v = [np.zeros_like(b) for b in tr.blocks]
    objectives = []
    for step in range(1, 4):
        objective, lm, aux, _ = moe_causal_lm_loss_float64(cfg, w, batch)
        objectives.append(objective)
        probe = ReferenceTrainer(cfg, w, lr=lr, grad_accum_dtype=np.float64)
        _, _, grads = probe.accumulate_grads(batch)
        want = []
        for p, g, mi, vi in zip(tr.blocks, grads, m, v):
            mi[...] = b1 * mi + (1 - b1) * g
            vi[...] = b2 * vi + (1 - b2) * g * g
            upd = (mi / (1 - b1**step)) / (np.sqrt(vi / (1 - b2**step)) + eps)
            want.append(p - lr * (wd * p + upd))
        res = tr.train_step(batch)
        res16 = tr16.train_step(batch)
        assert res.step == step and abs(res.loss_mean - lm) <= 1e-10 * lm
        assert abs(res.aux_loss - aux) <= 1e-10 * aux and res.z_loss is not None
        assert abs(res16.loss_mean - lm) <= 0.02 * lm
        for p, p_want in zip(tr.blocks, want):
            np.testing.assert_allclose(p, p_want, rtol=1e-12, atol=1e-15)
    assert objectives[-1] < objectives[0]


def test_dense_configs_train_as_before(rng):
    """A dense config's StepResult has no auxiliary values and its JSON no 'moe' key."""
    cfg = load_config("tiny")
    assert "moe" not in json.loads(cfg.to_json())
    tr = ReferenceTrainer(cfg, init_model(cfg, 1), lr=1e-3)
    res = tr.train_step(rng.integers(0, cfg.vocab_size, (1, 9)))
    assert res.aux_loss is None and res.z_loss is None


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "qwen3-30b-a3b"])
def test_moe_configs_round_trip_through_json(name, tmp_path):
    """The zoo entries and the test configs survive to_json -> from_json and load_config of a
    written file unchanged."""
    for cfg in (load_config(name), *CONFIGS.values()):
        assert from_json(ModelConfig, cfg.to_json()) == cfg
        path = tmp_path / f"{cfg.name}.json"
        path.write_text(cfg.to_json())
        assert load_config(path) == cfg


ZOO = {  # name: (family, total params, active params), as released
    "olmoe-1b-7b": ("olmoe", 6.919e9, 1.282e9),
    "qwen3-30b-a3b": ("qwen3_moe", 30.532e9, 3.353e9),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_moe_entries_have_the_released_parameter_and_active_flop_counts(name):
    """OLMoE-1B-7B: 6.92B parameters, 1.28B active; Qwen3-30B-A3B: 30.5B, 3.35B (to 0.1 %). The
    model FLOPs count the router and top_k experts, never all N: a layer's matmul FLOPs are 2 x
    its active matrix parameters per token, and the version string says so."""
    family, total, active = ZOO[name]
    cfg = load_config(name)
    assert cfg.family == family and cfg.moe is not None and cfg.moe.n_shared_experts == 0
    assert abs(cfg.n_params - total) < 1e-3 * total
    assert abs(cfg.active_params - active) < 1e-3 * active
    m, d = cfg.moe, cfg.model_dim
    matrices = d * (2 * cfg.q_dim + 2 * cfg.kv_dim) + m.n_experts * d \
        + 3 * m.top_k * d * m.expert_ffn_dim
    assert layer_matmul_flops(cfg, 100) == 2 * 100 * matrices
    dense_attn = model_flops_per_seq(cfg, 4096) - cfg.n_layers * 3 * layer_matmul_flops(
        cfg, 4096)
    assert model_flops_per_seq(cfg, 4096) == cfg.n_layers * 6 * 4096 * matrices + dense_attn
    assert flop_model_version(cfg) == MOE_FLOP_MODEL_VERSION
    assert flop_model_version(load_config("8b")) == FLOP_MODEL_VERSION == "mldf-1"
    # below FULL the engine re-forms the router and each routed row's gate, up AND down
    # (the combine weights' gradient reads every expert output: dataflow.moe_ffn)
    gate_up = 2 * 10 * d * (m.n_experts + 3 * m.top_k * m.expert_ffn_dim)
    q_and_o = 2 * 10 * d * 2 * cfg.q_dim
    assert level_recompute_flops(cfg, SavedLevel.INP_ATTN, 10) == q_and_o + gate_up \
        + 2 * 10 * d * cfg.kv_dim


def test_moe_layer_layout_keeps_each_expert_contiguous():
    """Attention and norms as a dense layer, then the router (N, D), then expert 0's gate, up,
    down, expert 1's, ..., then the shared experts, then the QK-norm weights."""
    cfg = SHARED
    lay = layer_layout(cfg)
    names = [t.name for t in lay.tensors]
    n, fe, d = cfg.moe.n_experts, cfg.moe.expert_ffn_dim, cfg.model_dim
    assert names[:7] == ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                         "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                         ROUTER_TENSOR]
    assert lay.slot(ROUTER_TENSOR).shape == (n, d)
    experts = [x for e in range(n) for x in expert_names(e)]
    assert names[7:7 + 3 * n] == experts
    assert names[7 + 3 * n:] == [*expert_names(0, shared=True), "self_attn.q_norm",
                                 "self_attn.k_norm"]
    assert [lay.slot(x).shape for x in expert_names(2)] == [(fe, d), (fe, d), (d, fe)]
    assert lay.full_name("mlp.experts.3.down_proj", 1) == \
        "model.layers.1.mlp.experts.3.down_proj.weight"
    assert lay.full_name(ROUTER_TENSOR, 0) == "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(family="olmoe", qk_norm=True), "give it a moe description"),
    (dict(family="qwen3", qk_norm=True, moe=OLMOE.moe), "has a dense FFN"),
    (dict(family="qwen3_moe", qk_norm=False, moe=OLMOE.moe), "qk_norm"),
])
def test_inconsistent_moe_configs_are_refused(kwargs, needle):
    """A MoE family without moe, a dense family with it, top_k above n_experts, and a
    Qwen3-MoE without its QK-norm are ConfigErrors."""
    base = {k: v for k, v in BASE.items() if k != "qk_norm"}
    with pytest.raises(ConfigError) as err:
        ModelConfig(name="bad", **base, **kwargs)
    assert needle in str(err.value)
    with pytest.raises(ConfigError, match="top_k 9 is more than n_experts 5"):
        dataclasses.replace(OLMOE.moe, top_k=9)


def test_planner_plans_moe_for_one_device_and_rings_and_refuses_shared_experts(capsys, tmp_path):
    """make_plan and `dataflow-plan ... qwen3-30b-a3b` plan an MoE config for one device (every
    expert moves with its layer's block) and, with --gpus 2, weigh data-parallel replicas and a
    ring of 2 (a ring rank's plan passes validate_decisions; a 4-layer config keeps it quick:
    the zoo model's table of 2-64 GPUs takes 50 s); a shared expert is refused by name."""
    from dataflow.memplan import get_profile
    from dataflow.memplan.plan.decisions import decisions_of, validate_decisions
    from dataflow.models.layout import layer_layout as lay_of

    cfg = load_config("qwen3-30b-a3b")
    plan = make_plan(cfg, 8192, Budget.from_gib(200, 80))
    assert plan.model == cfg and plan.memory.host_bytes > cfg.n_layers * lay_of(cfg).nbytes
    validate_decisions(dataclasses.replace(decisions_of(plan), holds_head=False))  # a ring rank
    with pytest.raises(ConfigError, match="1 shared expert.*no ops"):
        make_plan(SHARED, 16, Budget.from_gib(4, 1), get_profile("cpu"))
    capsys.readouterr()
    assert plan_main(["200", "80", "8192", "qwen3-30b-a3b"]) == 0
    capsys.readouterr()
    # --gpus: data-parallel replicas (rings of 1) and a ring of 2 are weighed
    # (tests/ring/test_ring_moe.py trains both)
    small = tmp_path / "moe4.json"
    small.write_text(to_json(dataclasses.replace(OLMOE, name="olmoe-tiny4", n_layers=4)))
    assert plan_main(["1", "0.5", "16", str(small), "--gpus", "2", "--gpu", "cpu"]) == 0
    out = capsys.readouterr()
    assert "2 x ring of 1" in out.out and "\n     2        1 " in out.out  # both weighed
    assert "not possible" not in out.out and "Traceback" not in out.err


def test_hf_export_of_an_moe_config_writes_its_family_and_refuses_shared_experts(tmp_path):
    """HF export of OLMoE / Qwen3-MoE is built (tests/models/test_hf_moe.py round-trips it):
    the zoo entry's config.json names its family and reads back as it; a shared expert, which
    neither family has, is refused by name."""
    from dataflow.models.hf import hf_config_dict, save_pretrained
    from dataflow.models.hf_config import hf_config

    cfg = load_config("olmoe-1b-7b")
    data = hf_config_dict(cfg)
    assert (data["model_type"], data["num_experts"], data["intermediate_size"]) == \
        ("olmoe", 64, 1024)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert hf_config(tmp_path, name=cfg.name) == cfg
    with pytest.raises(ConfigError, match="shared experts cannot be written"):
        save_pretrained(SHARED, [], tmp_path / "out")
