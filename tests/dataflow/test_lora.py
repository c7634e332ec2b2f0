"""LoRA on the NumPy engine against the float64 transcription (dataflow.lora_reference): the
step-1 loss, the adapters' gradients, the frozen base bit for bit, a few AdamW steps of the
adapters; on resident, streamed and recompute plans, and a QK-norm (Qwen3-like) shape."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow import Engine
from dataflow.lora_reference import LoraReferenceTrainer, loss_and_grads
from dataflow.memplan.plan.lora import Lora, adapter_model_flops_per_seq
from dataflow.memplan.plan.plan import Budget, OptimizerWhere, Where
from dataflow.memplan.search.build import with_segments
from dataflow.models.flops import SavedLevel, frozen_flops_per_seq, model_flops_per_seq
from tests.dataflow.plans import forced_plan, streamed
from dataflow.models.config import load_config

LR = 2e-3
LORA = Lora(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def _engine(cfg="tiny", seed=0, **kw):
    kw.setdefault("host_gb", 1)
    kw.setdefault("dev_gb", 0.5)
    return Engine(cfg, seqlen=32, backend="numpy", sanitize=True, lr=LR, max_grad_norm=None,
                  seed=seed, lora=LORA, **kw)


def _random_b(eng, rng):
    """Adapters with B random too (B = 0 at init makes every contribution zero)."""
    st = {k: v for k, v in eng.lora_state().items() if k.endswith((".a", ".b"))}
    st = {k: (rng.standard_normal(v.shape).astype(np.float32) * 0.05 if k.endswith(".b") else v)
          for k, v in st.items()}
    eng.load_lora_state(st)
    return st


def _batch(eng, rng):
    ch = eng.plan.chunking
    return rng.integers(0, eng.plan.model.vocab_size, (ch.seqs_per_step, ch.seqlen + 1))


def _rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


def _check(eng, seed):
    rng = np.random.default_rng(seed)
    print("seed", seed)
    adapters = _random_b(eng, rng)
    w0 = eng.state_dict()
    base = eng.weights()
    ref = LoraReferenceTrainer(base, eng.plan.lora, adapters, lr=LR)
    batches = [_batch(eng, rng) for _ in range(3)]
    for i, b in enumerate(batches):
        loss = eng.train_step(b).loss
        ref_loss = ref.step(b)
        assert abs(loss - ref_loss) < 0.01 * abs(ref_loss), (i, loss, ref_loss)
    got = eng.lora_state()
    for k, v in ref.adapters.items():
        moved = np.linalg.norm(v - adapters[k])
        assert moved > 0
        # three AdamW steps: Adam moves every element by about lr whatever its gradient's size,
        # so an element whose gradient is bf16 noise may step either way; over each matrix the
        # engine's path must follow the float64 one within a fifth of the distance travelled
        assert np.linalg.norm(got[k] - v) <= 0.2 * moved, (k, np.linalg.norm(got[k] - v), moved)
    w1 = eng.state_dict()
    for k in w0:
        if not k.startswith("optimizer."):
            assert np.array_equal(w0[k], w1[k]), k


def test_lora_gradients_match_float64_reference_on_a_resident_plan():
    """Step-1 loss and every adapter gradient within bf16 tolerance of the float64 oracle."""
    eng = _engine()
    rng = np.random.default_rng(11)
    adapters = _random_b(eng, rng)
    batch = _batch(eng, rng)
    ref_loss, ref_g = loss_and_grads(eng.weights(), eng.plan.lora, adapters, batch)
    eng.set_lr(0.0)  # AdamW at lr 0 leaves the adapters; '.grad' is the last step's gradient
    loss = eng.train_step(batch).loss
    got = eng.lora_state()
    assert abs(loss - ref_loss) < 0.005 * abs(ref_loss)
    for k, g in ref_g.items():
        assert np.abs(g).max() > 0, k
        assert _rel(got[k + ".grad"], g) < 0.05, (k, _rel(got[k + ".grad"], g))
    eng.close()


def test_lora_trajectory_and_frozen_base_on_a_resident_plan():
    """Three AdamW steps follow the float64 trajectory; the base stays bit-identical."""
    eng = _engine()
    assert all(p.weights.value == "device" for p in eng.plan.layers)
    _check(eng, 12)
    eng.close()


def _forced(name: str, cfg):
    """Forced plans over the executor's paths: streamed layers at every saved level, and split
    sequences (context K/V, activations at home)."""
    n, strm = cfg.n_layers, streamed(OptimizerWhere.HOST)
    lv = SavedLevel
    if name == "streamed":
        return forced_plan(cfg, 64, layers=(strm,) * n, weight_slots=2, grad_slots=0,
                           levels=[[lv.INP_ONLY, lv.INP_ATTN]] * n, chunk_tokens=64,
                           chunks_per_round=2, rounds=2, lora=LORA)
    if name == "segments":  # one segment of both layers: the backward re-runs its forward
        plan = forced_plan(cfg, 64, layers=(strm,) * n, weight_slots=2, grad_slots=0,
                           homes=[[Where.HOME, Where.DEVICE]] * n, chunk_tokens=64,
                           chunks_per_round=2, rounds=1, lora=LORA)
        big = with_segments(plan, n, Budget(host_bytes=1 << 32, device_bytes=1 << 32))
        return with_segments(big, n, Budget(
            host_bytes=big.memory.host_bytes,
            device_bytes=big.memory.device_bytes + big.profile.library_reserve_bytes))
    return forced_plan(cfg, 128, layers=(strm,) * n, weight_slots=2, grad_slots=0,
                       levels=[[lv.INP_ONLY, lv.INP_ATTN, lv.FULL, lv.INP_ONLY]] * n,
                       homes=[[Where.HOME, Where.DEVICE, Where.HOME, Where.HOME]] * n,
                       chunk_tokens=32, chunks_per_seq=4, chunks_per_round=4, rounds=1,
                       lora=LORA)


@pytest.mark.parametrize("name", ["streamed", "split", "segments"])
def test_lora_on_streamed_and_recompute_plans(name):
    """The same on plans that stream every layer and recompute (INP_ONLY / INP_ATTN), on split
    sequences whose chunks attend to earlier chunks' K/V, and with a layer segment re-run."""
    plan = _forced(name, load_config("tiny"))
    assert plan.lora == LORA and plan.frozen.anything
    assert name != "segments" or plan.segment_layers == 2
    eng = Engine.from_plan(plan, backend="numpy", sanitize=True, lr=LR, max_grad_norm=None)
    _check(eng, {"streamed": 13, "split": 15, "segments": 16}[name])
    eng.close()


def test_lora_on_a_qk_norm_model():
    """A Qwen3-like shape (q/k RMSNorm) trains its adapters as the oracle does."""
    cfg = dataclasses.replace(load_config("tiny"), name="tiny-qk", family="qwen3",
                              qk_norm=True)
    eng = _engine(cfg)
    _check(eng, 14)
    eng.close()


def test_a_measured_lora_step_counts_the_adapters_and_not_the_frozen_dw():
    """A LoRA engine's StepResult (NumPy backend, tiny model) counts the model FLOPs the plan's
    prediction counts (the whole model's less the frozen base's weight-gradient GEMMs, plus the
    adapters'), and says its FLOP model is mldf-1+lora-1."""
    lora = Lora(rank=4, alpha=8.0, targets=("q", "v", "down"))
    rng = np.random.default_rng(7)
    eng = Engine("tiny", seqlen=32, backend="numpy", host_gb=1, dev_gb=0.5, lr=1e-3, seed=0,
                 lora=lora)
    try:
        ch, cfg = eng.plan.chunking, eng.plan.model
        r = eng.train_step(rng.integers(0, cfg.vocab_size, (ch.seqs_per_step, ch.seqlen + 1)))
    finally:
        eng.close()
    expected = (model_flops_per_seq(cfg, ch.seqlen)
                - frozen_flops_per_seq(cfg, ch.seqlen, cfg.n_layers, True)
                + adapter_model_flops_per_seq(cfg, lora, ch.seqlen)) * ch.seqs_per_step
    assert r.model_tflop_per_s * 1e12 * r.step_time_s == pytest.approx(expected, rel=1e-9)
    assert r.flop_model_version == "mldf-1+lora-1"
    assert r.hfu > r.mfu
