"""Qwen2 (q/k/v biases) and Qwen3 (per-head RMSNorm of q and k) train as themselves: the reference
model equals a float64 transcription of transformers' Qwen2/Qwen3 attention and its gradients of
the new parameters equal finite differences of it; the engine on the NumPy backend gives the
step-1 loss, the new parameters' gradients and a few AdamW steps of a float64 trainer within
bf16 rounding; Hugging Face directories round-trip in each family's spelling; the planner counts
the new bytes and FLOPs; what these families do that is not built is refused by name."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.buffers import chunk_workspace_specs, packed_bytes
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel, hardware_flops_per_seq, level_recompute_flops
from dataflow.models.hf import hf_config_dict
from dataflow.models.hf_config import hf_config
from dataflow.models.init import BF16, init_model
from dataflow.models.layout import ALIGN_ELEMS, layer_layout
from dataflow.reference_model import forward_backward
from dataflow.reference_trainer import ReferenceTrainer
from tests.llama_float64 import llama_loss_float64
from tests.models.resume import train_save_resume
from tests.numeric import central_difference, weights_copy, weights_f64

BASE = ModelConfig(name="odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=2, n_heads=4,
                   n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)
QWEN2 = dataclasses.replace(BASE, name="qwen2-odd", family="qwen2", attention_bias=True)
QWEN3 = dataclasses.replace(BASE, name="qwen3-odd", family="qwen3", qk_norm=True, head_dim=32)
"""Qwen3 with an explicit head_dim: q_dim 128 is not model_dim 64, as in Qwen3's releases."""
FAMILIES = {"qwen2": QWEN2, "qwen3": QWEN3}
NEW = {"qwen2": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
       "qwen3": ("self_attn.q_norm", "self_attn.k_norm")}
BF16_ROUNDOFF = 2.0**-8
"""bf16's unit roundoff: the engine stores weights, activations, grads and m in bf16."""
FD_STEP = 1e-5


def _bf16_weights(cfg, rng):
    """A seeded init with every norm weight 1 + 0.2 N(0, 1) and every bias 0.3 N(0, 1): never
    the ones and zeros transformers starts them at, so their gradients are generic."""
    w = init_model(cfg, int(rng.integers(0, 2**31)))
    lay = layer_layout(cfg)
    for block in w.layers:
        for t in lay.tensors:
            if t.name.endswith("_norm") or t.name.endswith("layernorm"):
                value = 1.0 + 0.2 * rng.standard_normal(t.shape)
                lay.view(block, t.name)[...] = value.astype(BF16)
            elif t.name.endswith(".bias"):
                lay.view(block, t.name)[...] = (0.3 * rng.standard_normal(t.shape)).astype(BF16)
    return w


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_model_is_transformers_attention_and_new_grads_match_finite_differences(
        family, rng):
    """float64: our reference model's loss equals the transcription of transformers' class to
    1e-12, and its gradients of every bias / QK-norm weight (3 random coordinates each, every
    layer) equal central differences of the transcription to 1e-6 of the tensor's scale."""
    cfg = FAMILIES[family]
    w = weights_f64(_bf16_weights(cfg, rng))
    tokens = rng.integers(0, cfg.vocab_size, 17)
    loss, _, grads = forward_backward(cfg, w, tokens)
    truth = llama_loss_float64(cfg, w, tokens)
    assert abs(loss - truth) <= 1e-12 * abs(truth)
    lay = layer_layout(cfg)
    for layer, block in enumerate(w.layers):
        for name in NEW[family]:
            view, g = lay.view(block, name), lay.view(grads.layers[layer], name)
            scale = float(np.sqrt(np.mean(g**2)))
            assert scale > 0, (layer, name)
            for j in rng.choice(view.size, 3, replace=False):
                fd = central_difference(lambda: llama_loss_float64(cfg, w, tokens), view, j,
                                        FD_STEP)
                assert abs(fd - g[j]) <= 1e-6 * max(abs(g[j]), scale), (layer, name, j, fd, g[j])


def _mean_grads_f64(cfg, w, batch):
    """The float64 gradient of the token-mean loss over `batch`, per layer block."""
    n = batch.shape[0] * (batch.shape[1] - 1)
    total = [np.zeros_like(b) for b in w.layers]
    for row in batch:
        _, _, g = forward_backward(cfg, w, row, 1.0 / n)
        for acc, gl in zip(total, g.layers):
            acc += gl
    return total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_tracks_float64_transformers_loss_new_grads_and_adamw_steps(family, rng):
    """NumPy backend, bf16: step-1 loss within bf16 roundoff of the float64 transcription; the
    new parameters' step-1 gradients (AdamW's m / (1 - beta1)) no further from the float64
    gradient than twice the bf16 reference model's, plus the roundoff of storing m in bf16;
    three AdamW steps' losses within bf16 roundoff of a float64 trainer's."""
    cfg = FAMILIES[family]
    w = _bf16_weights(cfg, rng)
    batches = [rng.integers(0, cfg.vocab_size, (2, 33)) for _ in range(3)]
    lr, beta1 = 1e-3, 0.9
    f64 = ReferenceTrainer(cfg, weights_f64(w), lr=lr, grad_accum_dtype=np.float64)
    bf_ref = ReferenceTrainer(cfg, weights_copy(w), lr=lr)
    g_true = _mean_grads_f64(cfg, f64.weights, batches[0])
    _, _, g_bf = bf_ref.accumulate_grads(batches[0])
    lay = layer_layout(cfg)
    with Engine(cfg, host_gb=0.5, dev_gb=0.25, seqlen=32, seqs_per_step=2, backend="numpy",
                weights=w, lr=lr, betas=(beta1, 0.95), max_grad_norm=None, seed=0,
                sanitize=True) as eng:
        losses = [eng.train_step(batches[0]).loss]
        state = eng.state_dict()
        for b in batches[1:]:
            losses.append(eng.train_step(b).loss)
    n = batches[0].shape[0] * 32
    truth1 = sum(llama_loss_float64(cfg, f64.weights, row) for row in batches[0]) / n
    assert abs(losses[0] - truth1) <= BF16_ROUNDOFF * truth1
    for layer in range(cfg.n_layers):
        for name in NEW[family]:
            true = lay.view(g_true[layer], name)
            ours = state[f"optimizer.{lay.full_name(name, layer)}.exp_avg"].astype(np.float64)
            ours /= 1 - beta1
            bf = lay.view(g_bf[1 + layer], name).astype(np.float64)
            norm = np.linalg.norm(true)
            err, err_bf = np.linalg.norm(ours - true) / norm, np.linalg.norm(bf - true) / norm
            assert err <= 2 * err_bf + BF16_ROUNDOFF, (layer, name, err, err_bf)
    f64_losses = [f64.train_step(b).loss_mean for b in batches]
    np.testing.assert_allclose(losses, f64_losses, rtol=BF16_ROUNDOFF)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_directory_round_trips_in_the_familys_spelling(family, tmp_path, rng):
    """config.json + safetensors written in Qwen2's / Qwen3's spelling import as that family
    (biases and QK-norm weights included, bit for bit) and export in the same spelling with the
    same tensors."""
    st_numpy = pytest.importorskip("safetensors.numpy")
    cfg = FAMILIES[family]
    d = hf_config_dict(cfg)
    assert d["model_type"] == family and d["architectures"] == [f"Qwen{family[-1]}ForCausalLM"]
    assert d["use_sliding_window"] is False and d["tie_word_embeddings"] is False
    assert ("attention_bias" in d) == (family == "qwen3") and "mlp_bias" not in d
    with Engine(cfg, host_gb=0.5, dev_gb=0.25, seqlen=32, backend="numpy") as eng:
        shapes = {k: v.shape for k, v in eng.state_dict().items() if not k.startswith("optim")}
    assert all(any(k.endswith(f"{n}.weight") or k.endswith(n) for k in shapes)
               for n in NEW[family])
    tensors = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    src = tmp_path / "hf"
    src.mkdir()
    st_numpy.save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(d))
    got = hf_config(src)
    assert (got.family, got.attention_bias, got.qk_norm, got.head_dim) == \
        (family, cfg.attention_bias, cfg.qk_norm, cfg.head_dim)
    with Engine(str(src), host_gb=0.5, dev_gb=0.25, seqlen=32, backend="numpy") as eng:
        state = eng.state_dict()
        eng.save_pretrained(tmp_path / "out")
    for k, v in tensors.items():
        assert np.array_equal(state[k], v.astype(BF16)), k
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: out[k] for k in d if k != "max_position_embeddings"} == \
        {k: d[k] for k in d if k != "max_position_embeddings"}
    back = st_numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert np.array_equal(back[k].view(np.uint16), v.astype(BF16).view(np.uint16)), k


def test_planner_counts_the_new_parameters_workspace_and_recompute():
    """The new vectors are in the layer block (so in every weight, grad, m and v byte the
    planner counts), QK-norm's inputs and rstd in the chunk workspace, its re-projections in
    the hardware FLOPs; the plans' memory maps grow by them."""
    t = 64
    for cfg, extra in ((QWEN2, (BASE.q_dim, BASE.kv_dim, BASE.kv_dim)),
                       (QWEN3, (QWEN3.head_dim, QWEN3.head_dim))):
        plain = dataclasses.replace(cfg, family="llama", attention_bias=False, qk_norm=False)
        aligned = sum(-(-n // ALIGN_ELEMS) * ALIGN_ELEMS for n in extra)
        assert layer_layout(cfg).numel == layer_layout(plain).numel + aligned
        assert cfg.layer_params == plain.layer_params + sum(extra)
        prof, budget = get_profile("h100"), Budget.from_gib(1, 1)
        a, b = make_plan(cfg, t, budget, prof), make_plan(plain, t, budget, prof)
        assert a.memory.host_bytes + a.memory.device_bytes > \
            b.memory.host_bytes + b.memory.device_bytes
    ws = packed_bytes(chunk_workspace_specs(QWEN3, t)) - packed_bytes(
        chunk_workspace_specs(dataclasses.replace(QWEN3, family="llama", qk_norm=False), t))
    assert ws >= 2 * t * (QWEN3.q_dim + QWEN3.kv_dim) + 4 * t * (QWEN3.n_heads + QWEN3.n_kv_heads)
    d, q, kv = QWEN3.model_dim, QWEN3.q_dim, QWEN3.kv_dim
    assert level_recompute_flops(QWEN3, SavedLevel.FULL, t) == 2 * t * d * (q + kv)
    assert level_recompute_flops(QWEN2, SavedLevel.FULL, t) == 0
    assert level_recompute_flops(QWEN3, SavedLevel.INP_ATTN, t) == \
        level_recompute_flops(dataclasses.replace(QWEN3, family="llama", qk_norm=False),
                              SavedLevel.INP_ATTN, t) + 2 * t * d * kv
    full = [SavedLevel.FULL] * QWEN3.n_layers
    assert hardware_flops_per_seq(QWEN3, t, t, full) > hardware_flops_per_seq(
        dataclasses.replace(QWEN3, family="llama", qk_norm=False), t, t, full)


@pytest.mark.parametrize("name,family,params", [("qwen2.5-7b", "qwen2", 7.6156e9),
                                                ("qwen3-8b", "qwen3", 8.1907e9)])
def test_the_qwen_zoo_entries_have_the_released_shapes_and_plan(name, family, params):
    """Qwen2.5-7B (7.62 B parameters, biases included) and Qwen3-8B (8.19 B, QK-norm) plan at
    8k on an H100 under 80/24 GiB."""
    cfg = load_config(name)
    assert cfg.family == family and abs(cfg.n_params - params) < 1e-4 * params
    plan = make_plan(cfg, 8192, Budget.from_gib(80, 24), get_profile("h100"))
    assert plan.prediction.tok_per_s > 0


@pytest.mark.parametrize("family,key,value,why", [
    ("qwen2", "use_sliding_window", True, "use_sliding_window = True is not supported"),
    ("qwen3", "use_sliding_window", True, "use_sliding_window = True is not supported"),
    ("qwen3", "attention_bias", True, "attention_bias = True is not supported"),
    ("qwen2", "hidden_act", "gelu", "hidden_act = 'gelu' is not supported"),
    ("qwen2", "layer_types", ["full_attention", "sliding_attention"], "sliding_attention"),
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768}, "'yarn'")])
def test_what_qwen_families_do_beyond_our_kernels_is_refused_by_name(tmp_path, family, key,
                                                                      value, why):
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_dict(FAMILIES[family]),
                                                      key: value}))
    with pytest.raises(ConfigError, match=why):
        hf_config(tmp_path)


def test_a_family_that_cannot_express_the_computation_is_refused():
    """A config whose family's class would compute something else (Llama with QK-norm, Qwen2
    without biases) is refused, naming the family that fits."""
    with pytest.raises(ConfigError, match="family 'llama' computes.*family 'qwen3'"):
        dataclasses.replace(BASE, qk_norm=True)
    with pytest.raises(ConfigError, match="family 'qwen2' computes attention_bias=True"):
        dataclasses.replace(QWEN2, attention_bias=False)
    assert "qk_norm" not in BASE.to_json() and "attention_bias" not in BASE.to_json()
    assert json.loads(QWEN3.to_json())["qk_norm"] is True


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_resume_and_host_eval_carry_the_new_parameters(family, tmp_path, rng):
    """A checkpoint keeps the family and its parameters with their AdamW state: resuming gives
    the same losses bit for bit; the host-side evaluation (dataflow.host_forward) computes the
    family's attention, within bf16 rounding of the engine's own evaluation."""
    cfg = FAMILIES[family]
    batches = [rng.integers(0, cfg.vocab_size, (2, 33)) for _ in range(3)]
    kw = dict(host_gb=0.5, dev_gb=0.25, seqlen=32, seqs_per_step=2, backend="numpy",
              max_grad_norm=None)
    w = _bf16_weights(cfg, rng)
    first, ours, host, resumed, back = train_save_resume(
        lambda src: Engine(cfg, weights=w, **kw) if src is None else Engine(src, **kw),
        batches, tmp_path / "ck")
    assert abs(host - ours) <= BF16_ROUNDOFF * ours
    assert (back.family, back.attention_bias, back.qk_norm) == \
        (family, cfg.attention_bias, cfg.qk_norm)
    assert resumed == first
