"""Tied embeddings (ModelConfig.tie_embeddings, transformers' tie_word_embeddings) are one
parameter: the reference model equals a float64 transcription of transformers' tied model and
its table's gradient is the sum of the lookup's and the head's; the NumPy-backend engine gives
the step-1 loss, the tied gradient and a few AdamW steps of a float64 trainer within bf16
rounding, bit for bit across placements and update modes; Hugging Face directories import and
export tied (no lm_head.weight); checkpoints resume bit for bit; the planner counts the table
once and keeps it on the device; a ring of 2+ ranks is refused by name."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.decisions import HOME_HOST, HOME_STREAMED
from dataflow.memplan.plan.memory import device_regions, host_regions
from dataflow.memplan.plan.plan import Budget, GradAccum, Where
from dataflow.models.config import ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.hf import hf_config_dict
from dataflow.models.hf_config import hf_config
from dataflow.models.init import BF16, ModelWeights, init_model
from dataflow.models.layout import embed_layout, head_layout
from dataflow.optimizer import AdamWConfig
from dataflow.reference_model import forward_backward
from dataflow.reference_trainer import ReferenceTrainer
from tests.llama_float64 import llama_loss_float64
from tests.models.resume import train_save_resume
from tests.numeric import central_difference, weights_copy, weights_f64

TIED = ModelConfig(name="tied-odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=2,
                   n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6,
                   tie_embeddings=True)
UNTIED = dataclasses.replace(TIED, name="untied-odd", tie_embeddings=False)
BF16_ROUNDOFF = 2.0**-8
"""bf16's unit roundoff: the engine stores weights, activations, grads and m in bf16."""
FD_STEP = 1e-5
KW = dict(host_gb=0.5, dev_gb=0.25, seqlen=32, seqs_per_step=2, backend="numpy")


def _untied_copy(w):
    """The untied model whose lm_head starts as the tied table (float64 blocks)."""
    lay_h, table = head_layout(UNTIED), embed_layout(TIED).view(w.embed, "embed_tokens")
    head = np.zeros(lay_h.numel, w.head.dtype)
    lay_h.view(head, "norm")[...] = head_layout(TIED).view(w.head, "norm")
    lay_h.view(head, "lm_head")[...] = table
    return types.SimpleNamespace(embed=w.embed.copy(), layers=[b.copy() for b in w.layers],
                                 head=head)


def test_reference_model_is_transformers_tied_model_and_its_gradient_is_both_uses(rng):
    """float64: the loss equals the transcription of transformers' tied model to 1e-12; the
    table's gradient is the untied model's embedding gradient plus its lm_head gradient (the
    same weights, lm_head a copy of the table), and equals central differences of the
    transcription at a row the inputs use and at one only the head uses."""
    w = weights_f64(init_model(TIED, int(rng.integers(0, 2**31))))
    tokens = rng.integers(0, TIED.vocab_size // 2, 17)  # rows >= V/2 are the head's alone
    loss, _, grads = forward_backward(TIED, w, tokens)
    truth = llama_loss_float64(TIED, w, tokens)
    assert abs(loss - truth) <= 1e-12 * abs(truth)
    ut = _untied_copy(w)
    loss_u, _, g_u = forward_backward(UNTIED, ut, tokens)
    assert abs(loss_u - loss) <= 1e-12 * abs(loss)
    table_g = embed_layout(TIED).view(grads.embed, "embed_tokens")
    parts = (embed_layout(UNTIED).view(g_u.embed, "embed_tokens")
             + head_layout(UNTIED).view(g_u.head, "lm_head"))
    np.testing.assert_allclose(table_g, parts, rtol=0, atol=1e-12 * np.abs(parts).max())
    table = embed_layout(TIED).view(w.embed, "embed_tokens")
    scale = float(np.sqrt(np.mean(table_g**2)))
    for row in (int(tokens[3]), TIED.vocab_size - 1):
        col = int(rng.integers(0, TIED.model_dim))
        fd = central_difference(lambda: llama_loss_float64(TIED, w, tokens), table.reshape(-1),
                                row * TIED.model_dim + col, FD_STEP)
        assert abs(fd - table_g[row, col]) <= 1e-6 * max(abs(fd), scale), (row, col, fd)


def test_engine_tracks_float64_tied_loss_gradient_and_adamw_steps(rng):
    """NumPy backend, bf16, two rounds a step (the tied gradient accumulates over both): step-1
    loss within bf16 roundoff of the float64 transcription; the table's step-1 gradient (AdamW's
    m / (1 - beta1)) no further from the float64 gradient than twice the bf16 reference model's
    plus the roundoff of storing m in bf16; three AdamW steps' losses within bf16 roundoff of
    a float64 trainer's. Stored once: one table, one m, one v, no lm_head key."""
    w = init_model(TIED, int(rng.integers(0, 2**31)))
    batches = [rng.integers(0, TIED.vocab_size, (2, 33)) for _ in range(3)]
    lr, beta1 = 1e-3, 0.9
    f64 = ReferenceTrainer(TIED, weights_f64(w), lr=lr, grad_accum_dtype=np.float64)
    bf_ref = ReferenceTrainer(TIED, weights_copy(w), lr=lr)
    n = batches[0].shape[0] * 32
    g_true = np.zeros_like(f64.weights.embed)
    for row in batches[0]:
        g_true += forward_backward(TIED, f64.weights, row, 1.0 / n)[2].embed
    _, _, g_bf = bf_ref.accumulate_grads(batches[0])
    with Engine(TIED, weights=w, lr=lr, betas=(beta1, 0.95), max_grad_norm=None,
                plan_options={"chunk_tokens": 32, "chunks_per_round": 1, "rounds_per_step": 2},
                sanitize=True, **KW) as eng:
        assert eng.plan.chunking.rounds_per_step == 2 and eng.plan.embed.weights is Where.DEVICE
        losses = [eng.train_step(batches[0]).loss]
        state = eng.state_dict()
        losses += [eng.train_step(b).loss for b in batches[1:]]
    assert not any("lm_head" in k for k in state)
    assert {k for k in state if "embed_tokens" in k} == {
        "model.embed_tokens.weight", "optimizer.model.embed_tokens.weight.exp_avg",
        "optimizer.model.embed_tokens.weight.exp_avg_sq"}
    truth1 = sum(llama_loss_float64(TIED, f64.weights, row) for row in batches[0]) / n
    assert abs(losses[0] - truth1) <= BF16_ROUNDOFF * truth1
    lay = embed_layout(TIED)
    true = lay.view(g_true, "embed_tokens")
    ours = state["optimizer.model.embed_tokens.weight.exp_avg"].astype(np.float64) / (1 - beta1)
    bf = lay.view(g_bf[0], "embed_tokens").astype(np.float64)
    norm = np.linalg.norm(true)
    err, err_bf = np.linalg.norm(ours - true) / norm, np.linalg.norm(bf - true) / norm
    assert err <= 2 * err_bf + BF16_ROUNDOFF, (err, err_bf)
    f64_losses = [f64.train_step(b).loss_mean for b in batches]
    np.testing.assert_allclose(losses, f64_losses, rtol=BF16_ROUNDOFF)


def _tied_plans():
    """Forced plans of the tied model that share one chunking (2 chunks a round, 2 rounds):
    the table resident, the head's norm resident or streamed, layers resident or streamed."""
    from dataflow.memplan.plan.plan import OptimizerWhere
    from dataflow.models.flops import SavedLevel
    from tests.dataflow.plans import forced_plan, streamed

    cfg = TIED
    n = cfg.n_layers
    common = dict(chunk_tokens=64, seqs_per_chunk=2, chunks_per_round=2, rounds=2)
    host, strm = streamed(OptimizerWhere.HOST), streamed(OptimizerWhere.STREAMED)
    levels = [[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN]] * n
    return cfg, [
        ("all_resident", forced_plan(cfg, 32, **common)),
        ("streamed_host_opt_head_home", forced_plan(cfg, 32, layers=(host,) * n,
                                                    head=HOME_HOST, weight_slots=1, **common)),
        ("streamed_opt_head_streamed_acts_home", forced_plan(
            cfg, 32, layers=(strm,) * n, head=HOME_STREAMED, levels=levels,
            homes=[[Where.HOME, Where.DEVICE]] * n, weight_slots=2, grad_slots=2, **common)),
    ]


def test_tied_placements_and_update_modes_are_bit_identical(rng):
    """Where the layers and the head's norm live, and where AdamW runs (at the end, deferred
    into the next step, inside the last round), only move bytes: two steps give the same
    losses and the same final weights, m and v bit for bit; one plan runs sanitized."""
    from dataflow.data import token_stream

    cfg, plans = _tied_plans()
    w = init_model(cfg, int(rng.integers(0, 2**31)))
    runs = [(plans[0][0], plans[0][1], "deferred"), (plans[1][0], plans[1][1], "deferred"),
            (plans[0][0], plans[0][1], "end"), (plans[2][0], plans[2][1], "backward")]
    results = []
    for i, (name, plan, mode) in enumerate(runs):
        ch = plan.chunking
        with Engine.from_plan(plan, backend="numpy", weights=_copy_weights(w),
                              optimizer=AdamWConfig(lr=1e-3, max_grad_norm=None),
                              deferred_update=mode == "deferred",
                              backward_update=mode == "backward", sanitize=i == 3) as eng:
            losses = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                                  start=s * ch.seqs_per_step * ch.seqlen)).loss
                      for s in range(2)]
            results.append((f"{name}/{mode}", losses, eng.state_dict()))
    name0, losses0, state0 = results[0]
    for name, losses, state in results[1:]:
        assert losses == losses0, (name, losses, losses0)
        assert sorted(state) == sorted(state0)
        for k, v in state0.items():
            assert np.array_equal(np.asarray(state[k]).reshape(-1).view(np.uint8),
                                  np.asarray(v).reshape(-1).view(np.uint8)), (name, k)


def _copy_weights(w):
    return ModelWeights(w.cfg, w.embed.copy(), [b.copy() for b in w.layers], w.head.copy())


def test_a_tied_plan_with_the_table_at_home_is_refused():
    """The head reads the table on the device: a plan keeping it at home is refused by name."""
    from tests.dataflow.plans import forced_plan

    cfg, _ = _tied_plans()
    with pytest.raises(ConfigError, match="ties its head to the embedding.*must be resident"):
        forced_plan(cfg, 32, chunk_tokens=32, embed=HOME_HOST, head=HOME_HOST)


def _hf_tensors(cfg, rng) -> dict:
    with Engine(cfg, **KW) as eng:
        shapes = {k: v.shape for k, v in eng.state_dict().items() if not k.startswith("optim")}
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def test_hf_directory_round_trips_tied(tmp_path, rng):
    """A tie_word_embeddings directory without lm_head.weight (as transformers saves one)
    imports tied and exports with tie_word_embeddings true and no lm_head.weight, the tensors
    bit for bit; one that stores lm_head.weight equal to the embedding imports the same, one
    whose lm_head.weight differs is refused by name."""
    st_numpy = pytest.importorskip("safetensors.numpy")
    d = hf_config_dict(TIED)
    assert d["tie_word_embeddings"] is True and hf_config_dict(UNTIED)["tie_word_embeddings"] \
        is False
    tensors = _hf_tensors(TIED, rng)
    assert "lm_head.weight" not in tensors

    def write(name, extra):
        src = tmp_path / name
        src.mkdir()
        st_numpy.save_file({**tensors, **extra}, src / "model.safetensors",
                           metadata={"format": "pt"})
        (src / "config.json").write_text(json.dumps(d))
        return src

    src = write("hf", {})
    assert hf_config(src).tie_embeddings
    with Engine(str(src), **KW) as eng:
        state = eng.state_dict()
        eng.save_pretrained(tmp_path / "out")
    for k, v in tensors.items():
        assert np.array_equal(state[k], v.astype(BF16)), k
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["tie_word_embeddings"] is True
    back = st_numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert np.array_equal(back[k].view(np.uint16), v.astype(BF16).view(np.uint16)), k
    same = write("with_head", {"lm_head.weight": tensors["model.embed_tokens.weight"]})
    with Engine(str(same), **KW) as eng:
        again = eng.state_dict()
    assert all(np.array_equal(again[k].view(np.uint16), state[k].view(np.uint16))
               for k in state if not k.startswith("optimizer."))
    other = write("other_head", {"lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    with pytest.raises(ConfigError, match="lm_head.weight differs from model.embed_tokens"):
        Engine(str(other), **KW)


def test_checkpoint_resume_and_host_eval_of_a_tied_model(tmp_path, rng):
    """A checkpoint keeps the tie and the table's AdamW state: resuming gives the same losses
    bit for bit; the host-side evaluation reads the table as the head, within bf16 rounding of
    the engine's own evaluation."""
    batches = [rng.integers(0, TIED.vocab_size, (2, 33)) for _ in range(3)]
    kw, seed = dict(KW, max_grad_norm=None), int(rng.integers(0, 2**31))
    first, ours, host, resumed, cfg = train_save_resume(
        lambda src: Engine(TIED, seed=seed, **kw) if src is None else Engine(src, **kw),
        batches, tmp_path / "ck")
    assert abs(host - ours) <= BF16_ROUNDOFF * ours
    assert cfg.tie_embeddings
    assert resumed == first


def test_planner_counts_the_tied_table_once():
    """The same decisions for the tied and the untied model: the tied one's regions lack
    exactly the head's (V, D) weights, gradient, m and v; parameters count the table once;
    the config JSON of an untied model does not mention the tie."""
    prof = get_profile("h100")
    for grad_accum, gbpe in ((GradAccum.BF16, 2), (GradAccum.FP32, 4)):
        plan = make_plan(TIED, 64, Budget.from_gib(1, 1), prof, grad_accum=grad_accum)
        assert plan.embed.weights is Where.DEVICE
        untied = dataclasses.replace(plan, model=UNTIED)
        vd = head_layout(UNTIED).numel - head_layout(TIED).numel
        assert vd >= UNTIED.vocab_size * UNTIED.model_dim
        dev = sum(n for _, n in device_regions(untied)) - sum(n for _, n in device_regions(plan))
        host = sum(n for _, n in host_regions(untied)) - sum(n for _, n in host_regions(plan))
        head_here = {Where.DEVICE: (dev, host), Where.HOME: (host, dev)}[plan.head.weights]
        # the head's weights and gradient always have a device region (resident or a slot)
        assert dev >= vd * (2 + gbpe) and dev + host == vd * (2 + gbpe) * (
            2 if plan.head.weights is Where.HOME else 1) + vd * 4, (dev, host, head_here)
    assert UNTIED.n_params - TIED.n_params == TIED.vocab_size * TIED.model_dim
    assert "tie_embeddings" not in UNTIED.to_json()
    assert json.loads(TIED.to_json())["tie_embeddings"] is True


def test_llama32_1b_zoo_entry_has_the_released_shape_and_plans():
    """Llama 3.2 1B: 1,235,814,400 parameters (the table once), llama3 RoPE scaling with factor
    32, tied on export; plans at 8k under 40/16 GiB with the table resident."""
    cfg = load_config("llama3.2-1b")
    assert cfg.n_params == 1_235_814_400 and cfg.tie_embeddings
    sc = cfg.rope_scaling
    assert (sc.factor, sc.low_freq_factor, sc.high_freq_factor,
            sc.original_max_position_embeddings) == (32.0, 1.0, 4.0, 8192)
    d = hf_config_dict(cfg)
    assert d["tie_word_embeddings"] is True and d["rope_scaling"]["rope_type"] == "llama3"
    plan = make_plan(cfg, 8192, Budget.from_gib(40, 16), get_profile("h100"))
    assert plan.embed.weights is Where.DEVICE and plan.prediction.tok_per_s > 0


def test_ring_of_two_refuses_a_tied_model_and_rings_of_one_plan_it():
    """A ring of 2+ would put the one parameter on two ranks: refused, naming the reason and
    what works; rings of 1 (data-parallel replicas) plan it."""
    from dataflow.memplan.search.ring_plan import make_rank_plans

    cfg = dataclasses.replace(load_config("tiny"), name="tiny-tied", tie_embeddings=True)
    budget = Budget.from_gib(1, 1)
    with pytest.raises(ConfigError, match="ties its head to the embedding.*ring of 2.*one GPU or "
                                          "as data-parallel replicas"):
        make_rank_plans(cfg, 64, budget, get_profile("h100"), 2)
    (rp,) = make_rank_plans(cfg, 64, budget, get_profile("h100"), 1, replicas=2)
    assert rp.plan.holds_embed and rp.plan.holds_head and rp.plan.embed.weights is Where.DEVICE


def test_two_data_parallel_replicas_train_a_tied_model_as_one_device(tmp_path, rng):
    """2 replicas of a ring of 1 (2 CPU processes; the table's gradient, both parts, is
    all-reduced once, after the last round's scatter) against one device running the same
    global batch as 2 rounds. With fp32 accumulation every untied parameter's gradient is
    g1 + g2 either way, so those weights are bit-identical (as tests/ring/test_ring_cpu.py shows
    for untied models). The tied table's is not: one device adds ((h1 + s1) + h2) + s2 (head,
    then scatter, each round), a replica pair (h1 + s1) + (h2 + s2), so its fp32 gradient differs
    in the last bits and, rarely, a bf16 weight by one step (seed 5980366039637034930: 1 of
    32,768 elements). The step-1 loss precedes any update and is exact; later losses within
    1e-6."""
    from dataflow.models.serial import to_json
    from dataflow.memplan.plan.plan import GradAccum
    from dataflow.ring.job import RingJob
    from tests.ring.test_ring_cpu import _ring, _single_device

    cfg = dataclasses.replace(load_config("tiny"), name="tiny-tied", tie_embeddings=True)
    job = RingJob(gpus=2, model=to_json(cfg), seqlen=64, host_gb=0.25, dev_gb=0.25, steps=2,
                  seed=int(rng.integers(0, 2**31)), data=f"random:{int(rng.integers(0, 2**31))}",
                  lr=1e-2, timeout_s=60, out_dir=str(tmp_path), grad_accum=GradAccum.FP32,
                  replicas=2,
                  constraints=(("chunk_tokens", 64), ("chunks_per_round", 1),
                               ("rounds_per_step", 1)))
    want_losses, want = _single_device(job, rounds_per_step=2)
    losses, got, _ = _ring(job)
    assert want_losses[1] != want_losses[0]
    for row in losses:
        assert row[0] == want_losses[0] and row == pytest.approx(want_losses, rel=1e-6)
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = got[key].view(np.uint16), want[key].view(np.uint16)
        if key != "embed":
            assert np.array_equal(g, w), key
            continue
        # one bf16 step apart at most (same sign: adjacent bit patterns), on few elements
        steps = np.abs(g.astype(np.int32) - w.astype(np.int32))
        assert steps.max() <= 1 and np.count_nonzero(steps) <= max(1, g.size // 1000), key
