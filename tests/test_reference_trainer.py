"""The reference model and trainer: the whole-model forward equals an independent float64
transcription of transformers' Llama, its backward passes finite-difference checks on `tiny` in
float64, gradients accumulate and clip as documented, and training on the shipped text lowers
the loss."""

import math
import types

import ml_dtypes
import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.reference_trainer import ReferenceTrainer
from dataflow.kernels.reference import IGNORE
from dataflow.reference_model import forward_backward
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.init import init_model
from dataflow.models.layout import embed_layout, head_layout, layer_layout
from tests.llama_float64 import llama_loss_float64
from tests.numeric import central_difference

BF16 = np.dtype(ml_dtypes.bfloat16)
FD_STEP = 1e-5
"""Central-difference step on unit-scale float64 weights (about eps^(1/3))."""


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def float64_weights(cfg, rng):
    """tiny's seeded bf16 init as float64 blocks, norms moved off 1 so their gradients are
    generic; padding stays zero."""
    w = init_model(cfg, int(rng.integers(0, 2**31)))
    blocks = types.SimpleNamespace(embed=w.embed.astype(np.float64),
                                   layers=[b.astype(np.float64) for b in w.layers],
                                   head=w.head.astype(np.float64))
    lay_l, lay_h = layer_layout(cfg), head_layout(cfg)
    for b in blocks.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            lay_l.view(b, name)[...] += 0.2 * rng.standard_normal(cfg.model_dim)
    lay_h.view(blocks.head, "norm")[...] += 0.2 * rng.standard_normal(cfg.model_dim)
    return blocks


def all_blocks(w):
    return [w.embed, *w.layers, w.head]


def random_tokens(cfg, rng, seqlen):
    """(seqlen + 1,) random ids whose last target is IGNORE (every other token is also an input,
    which may not be IGNORE)."""
    tokens = rng.integers(0, cfg.vocab_size, size=seqlen + 1)
    tokens[-1] = IGNORE
    return tokens


def test_model_forward_equals_independent_float64_llama(tiny, rng):
    """forward_backward's float64 loss equals a direct transcription of transformers' Llama to
    1e-12 relative (the two differ only in summation order)."""
    w = float64_weights(tiny, rng)
    tokens = random_tokens(tiny, rng, 24)
    loss_sum, n_tokens, _ = forward_backward(tiny, w, tokens)
    assert n_tokens == 23  # 24 targets, the last ignored
    ref = llama_loss_float64(tiny, w, tokens)
    assert abs(loss_sum - ref) <= 1e-12 * abs(ref)


def test_model_gradients_match_finite_differences_on_tiny_in_float64(tiny, rng):
    """On tiny in float64, grads equal central differences at two random coordinates of every
    tensor of every block and along a random direction through all blocks.

    Bounds: per coordinate |fd - g| <= 1e-6 * max(|g|, rms of that tensor's gradient); the
    directional derivative to 1e-7 relative. Central differences at step 1e-5 err by ~1e-10
    of the gradient's scale, so any wrong term fails by orders of magnitude."""
    w = float64_weights(tiny, rng)
    tokens = random_tokens(tiny, rng, 12)
    inputs = tokens[:-1]
    grad_scale = 1.0 / 11
    _, _, grads = forward_backward(tiny, w, tokens, grad_scale)
    assert all(g.dtype == np.float64 for g in grads.blocks())

    def loss() -> float:
        return grad_scale * forward_backward(tiny, w, tokens, grad_scale)[0]

    def fd_at(block: np.ndarray, index: int) -> float:
        return central_difference(loss, block, index, FD_STEP)

    layouts = [embed_layout(tiny)] + [layer_layout(tiny)] * tiny.n_layers + [head_layout(tiny)]
    for layout, block, grad in zip(layouts, all_blocks(w), grads.blocks()):
        for slot in layout.tensors:
            g_tensor = grad[slot.offset:slot.offset + slot.numel]
            rms = float(np.sqrt(np.mean(g_tensor**2)))
            assert rms > 0, f"{slot.name}: zero gradient"
            if slot.name == "embed_tokens":  # rows of tokens in the input; the rest are zero
                rows = rng.choice(inputs, size=2)
                picks = rows * tiny.model_dim + rng.integers(0, tiny.model_dim, size=2)
            else:
                picks = rng.integers(0, slot.numel, size=2)
            for i in slot.offset + picks:
                fd = fd_at(block, i)
                err = abs(fd - grad[i])
                assert err <= 1e-6 * max(abs(grad[i]), rms), (slot.name, i, fd, grad[i])
        used = np.zeros(layout.numel, bool)
        for slot in layout.tensors:
            used[slot.offset:slot.offset + slot.numel] = True
        assert np.all(grad[~used] == 0.0), "gradient in the alignment padding"
    unused_rows = np.setdiff1d(np.arange(tiny.vocab_size), inputs)
    table_grad = embed_layout(tiny).view(grads.embed, "embed_tokens")
    assert np.all(table_grad[unused_rows] == 0.0)

    direction = [rng.standard_normal(b.size) * (g != 0) for b, g in
                 zip(all_blocks(w), grads.blocks())]  # nonzero only where the loss depends
    norm = math.sqrt(sum(float(d @ d) for d in direction))
    direction = [d / norm for d in direction]
    analytic = sum(float(g @ d) for g, d in zip(grads.blocks(), direction))
    originals = [b.copy() for b in all_blocks(w)]
    values = []
    for sign in (1.0, -1.0):
        for b, o, d in zip(all_blocks(w), originals, direction):
            b[...] = o + sign * FD_STEP * d
        values.append(loss())
    for b, o in zip(all_blocks(w), originals):
        b[...] = o
    numeric = (values[0] - values[1]) / (2 * FD_STEP)
    # Relative to the derivative's typical size along a random unit direction, |g| / sqrt(n),
    # too: a direction nearly orthogonal to g makes |analytic| arbitrarily small.
    gnorm = math.sqrt(sum(float(g @ g) for g in grads.blocks()))
    typical = gnorm / math.sqrt(sum(int(np.count_nonzero(d)) for d in direction))
    assert abs(numeric - analytic) <= 1e-7 * max(abs(analytic), typical), \
        (numeric, analytic, typical)


def test_bf16_model_tracks_float64_model_within_bf16_rounding(tiny, rng):
    """With the same bf16 weights, bf16 activations give a loss within 2^-8 relative of float64
    and fp32 gradients pointing the same way (cosine > 0.999; ~0.99999 observed), in fp32 1-D
    blocks."""
    w = init_model(tiny, int(rng.integers(0, 2**31)))
    tokens = token_stream(32, 1, tiny.vocab_size, start=int(rng.integers(0, 10_000)))[0]
    loss_b, n_b, g_b = forward_backward(tiny, w, tokens, 1 / 32)
    w64 = types.SimpleNamespace(embed=w.embed.astype(np.float64),
                                layers=[b.astype(np.float64) for b in w.layers],
                                head=w.head.astype(np.float64))
    loss_64, n_64, g_64 = forward_backward(tiny, w64, tokens, 1 / 32)
    assert n_b == n_64 == 32
    assert abs(loss_b - loss_64) <= 2.0**-8 * loss_64
    for gb, g64, b in zip(g_b.blocks(), g_64.blocks(), all_blocks(w)):
        assert gb.dtype == np.float32 and gb.shape == b.shape
        cos = float(gb.astype(np.float64) @ g64 / (np.linalg.norm(gb) * np.linalg.norm(g64)))
        assert cos > 0.999


def test_model_refuses_token_ids_outside_the_vocabulary(tiny, rng):
    """An input id >= vocab_size is refused with the id and the vocabulary named."""
    w = init_model(tiny, 0)
    tokens = rng.integers(0, tiny.vocab_size, size=9)
    tokens[3] = tiny.vocab_size + 7
    with pytest.raises(ValueError, match=f"{tiny.vocab_size + 7}.*\\[0, {tiny.vocab_size}\\)"):
        forward_backward(tiny, w, tokens)


# --- the trainer -------------------------------------------------------------------------------


def test_accumulated_gradient_is_the_token_mean_over_the_batch(tiny, rng):
    """accumulate_grads sums each sequence's gradient scaled by 1 / (valid targets in the whole
    batch), and loss_mean is the summed loss over those targets."""
    w = float64_weights(tiny, rng)
    batch = np.stack([random_tokens(tiny, rng, 10) for _ in range(3)])
    trainer = ReferenceTrainer(tiny, w, lr=1e-3, grad_accum_dtype=np.float64)
    loss_mean, n_tokens, grads = trainer.accumulate_grads(batch)
    assert n_tokens == 3 * 9
    per_seq = [forward_backward(tiny, w, row) for row in batch]
    assert abs(loss_mean - sum(p[0] for p in per_seq) / n_tokens) <= 1e-12 * loss_mean
    for i, g in enumerate(grads):
        want = sum(p[2].blocks()[i] for p in per_seq) / n_tokens
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-14 * np.abs(want).max())


def test_train_step_applies_adamw_to_every_block_and_counts_steps(tiny, rng):
    """One step changes every bf16 block in place, keeps bf16 m/v, and counts from 1."""
    w = init_model(tiny, int(rng.integers(0, 2**31)))
    before = [b.copy() for b in all_blocks(w)]
    trainer = ReferenceTrainer(tiny, w, lr=1e-3)
    assert all(a is b for a, b in zip(trainer.blocks, all_blocks(w)))  # no copies
    result = trainer.train_step(token_stream(16, 2, tiny.vocab_size))
    assert result.step == trainer.step == 1 and result.n_tokens == 32
    assert result.clip_coef == 1.0 and result.grad_norm > 0
    for b, old, m, v in zip(all_blocks(w), before, trainer.m, trainer.v):
        assert b.dtype == m.dtype == v.dtype == BF16
        assert not np.array_equal(b.view(np.uint16), old.view(np.uint16))
    assert trainer.train_step(token_stream(16, 2, tiny.vocab_size, start=32)).step == 2


def test_gradient_clipping_folds_into_adamw_grad_scale(tiny, rng):
    """With max_grad_norm below the gradient norm, AdamW's first moment is the unclipped one
    times max_grad_norm / (norm + 1e-6), as torch's clip_grad_norm_ would scale it."""
    batch = token_stream(12, 2, tiny.vocab_size, start=int(rng.integers(0, 10_000)))
    seed = int(rng.integers(0, 2**31))
    plain, clipped = [ReferenceTrainer(tiny, float64_weights(tiny, np.random.default_rng(seed)),
                                       lr=1e-3, grad_accum_dtype=np.float64, max_grad_norm=c)
                      for c in (None, 0.05)]
    r_plain, r_clip = plain.train_step(batch), clipped.train_step(batch)
    assert r_plain.grad_norm > 0.05 and r_plain.clip_coef == 1.0
    assert r_clip.grad_norm == pytest.approx(r_plain.grad_norm, rel=1e-12)
    assert r_clip.clip_coef == pytest.approx(0.05 / (r_plain.grad_norm + 1e-6), rel=1e-12)
    for m_c, m_p in zip(clipped.m, plain.m):
        np.testing.assert_allclose(m_c, r_clip.clip_coef * m_p, rtol=1e-12, atol=1e-300)


def test_fp32_gradient_accumulation_is_more_precise_than_bf16(tiny, rng):
    """Accumulating 8 sequences' gradients in fp32 stays much closer to float64 accumulation of
    the same fp32 gradients than accumulating in bf16 (ml_dataflow's choice) does."""
    w = init_model(tiny, int(rng.integers(0, 2**31)))
    batch = token_stream(16, 8, tiny.vocab_size, start=int(rng.integers(0, 10_000)))
    err = {}
    exact = ReferenceTrainer(tiny, w, lr=1e-3, grad_accum_dtype=np.float64).accumulate_grads(
        batch)[2]
    for dt in (np.float32, BF16):
        got = ReferenceTrainer(tiny, w, lr=1e-3, grad_accum_dtype=dt).accumulate_grads(batch)[2]
        err[np.dtype(dt).name] = max(float(np.linalg.norm(g.astype(np.float64) - e)
                                           / np.linalg.norm(e)) for g, e in zip(got, exact))
    assert err["float32"] <= 8 * 2.0**-24    # a few fp32 roundings per element
    assert err["bfloat16"] >= 2.0**-10      # bf16 keeps 8 bits: ~2^-9 per rounding
    assert err["float32"] * 1000 < err["bfloat16"]


def test_trainer_refuses_bad_hyperparameters_and_batches(tiny):
    """Non-positive lr, an unsupported accumulator dtype and a 1-D batch are refused by name."""
    w = init_model(tiny, 0)
    with pytest.raises(ConfigError, match="lr must be positive, got 0"):
        ReferenceTrainer(tiny, w, lr=0)
    with pytest.raises(ConfigError, match="float16"):
        ReferenceTrainer(tiny, w, lr=1e-3, grad_accum_dtype=np.float16)
    with pytest.raises(ConfigError, match=r"\(17,\)"):
        ReferenceTrainer(tiny, w, lr=1e-3).accumulate_grads(np.zeros(17, np.int32))


def test_reference_trainer_loss_falls_over_20_steps_on_shipped_text(tiny, rng):
    """tiny at seqlen 64, 4 sequences per step, lr 3e-3 on consecutive shipped-text batches:
    the step-20 loss is at least 2 nats below the step-1 loss (~6.4 -> ~3.3 observed)."""
    trainer = ReferenceTrainer(tiny, init_model(tiny, int(rng.integers(0, 2**31))), lr=3e-3)
    seqlen, n_seqs = 64, 4
    start = int(rng.integers(0, 100_000))
    losses = []
    for step in range(20):
        batch = token_stream(seqlen, n_seqs, tiny.vocab_size, start=start + step * seqlen * n_seqs)
        losses.append(trainer.train_step(batch).loss_mean)
    assert all(np.isfinite(losses))
    assert losses[-1] <= losses[0] - 2.0, losses
