"""Finite-difference gradient checks for every backward of dataflow.kernels.reference, plus the forward
definitions they rest on (attention against a direct masked softmax, the chunked head loss against
full logits, AdamW against a hand-written float64 formula).

Every check uses float64 inputs on small shapes drawn fresh from the `rng` fixture (its seed is
printed on failure). The scalar under test is a random projection of the op's output,
L = sum(out * R) with R random, so backward(dy=R) must equal dL/dinput. Central differences with
step H = tests.numeric.STEP = 1e-5 give a truncation error O(H^2) ~ 1e-10 and a rounding
error ~ 1e-16 |L| / H ~ 1e-10, so
the norm-wise relative error bound GRAD_REL_BOUND = 1e-6 leaves four orders of margin while still
catching any wrong term (a wrong term gives an error of order 1)."""

import numpy as np
import pytest

from dataflow.kernels.reference import (IGNORE, adamw_step, attention_bwd, attention_fwd, embedding_bwd,
                               embedding_fwd, head_loss_fwd_bwd, linear_bwd, linear_fwd,
                               rms_norm_bwd, rms_norm_fwd, rope_bwd, rope_fwd, swiglu_bwd,
                               swiglu_fwd)
from tests.numeric import numeric_grad

GRAD_REL_BOUND = 1e-6
"""Norm-wise relative error allowed between analytic and finite-difference gradients."""
ROUNDING_REL_BOUND = 1e-12
"""Relative difference allowed where two float64 computations differ only in summation order."""


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / max(||a||, ||b||): norm-wise relative error (0 when both are zero)."""
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else 0.0


def assert_grad_close(analytic: np.ndarray, numeric: np.ndarray, what: str) -> None:
    assert analytic.shape == numeric.shape, what
    assert np.linalg.norm(numeric) > 0, f"{what}: finite differences are all zero; vacuous check"
    err = rel_err(analytic, numeric)
    assert err < GRAD_REL_BOUND, f"{what}: relative error {err:.3e} >= {GRAD_REL_BOUND}"


# --- embedding, rms_norm, linear, rope, swiglu ----------------------------------------------


def test_embedding_bwd_matches_finite_differences(rng):
    """embedding_bwd scatter-adds dy into the rows of the ids, repeated ids summing."""
    vocab, d, t = 7, 5, 9
    table = rng.standard_normal((vocab, d))
    ids = rng.integers(0, vocab, size=t)
    ids[-1] = ids[0]  # at least one repeated id
    r = rng.standard_normal((t, d))
    loss = lambda: float(np.sum(embedding_fwd(ids, table) * r))  # noqa: E731
    dtable = embedding_bwd(ids, r, vocab)
    assert dtable.dtype == np.float64
    assert_grad_close(dtable, numeric_grad(loss, table), "embedding dtable")
    unused = np.setdiff1d(np.arange(vocab), ids)
    assert np.all(dtable[unused] == 0.0)


def test_rms_norm_bwd_matches_finite_differences(rng):
    """rms_norm_bwd gives dx and dw of (x * rstd) * w, rstd = 1 / sqrt(mean(x^2) + eps)."""
    t, d, eps = 6, 8, 1e-5
    x = rng.standard_normal((t, d)) * rng.uniform(0.1, 3.0, size=(t, 1))
    w = rng.standard_normal(d)
    r = rng.standard_normal((t, d))
    loss = lambda: float(np.sum(rms_norm_fwd(x, w, eps)[0] * r))  # noqa: E731
    y, rstd = rms_norm_fwd(x, w, eps)
    np.testing.assert_allclose(y, x / np.sqrt(np.mean(x**2, axis=1, keepdims=True) + eps) * w,
                               rtol=ROUNDING_REL_BOUND)
    dx, dw = rms_norm_bwd(x, w, rstd, r)
    assert_grad_close(dx, numeric_grad(loss, x), "rms_norm dx")
    assert_grad_close(dw, numeric_grad(loss, w), "rms_norm dw")


def test_linear_bwd_matches_finite_differences(rng):
    """linear_bwd gives dx = dy @ w and dw = dy.T @ x for y = x @ w.T, w stored [out, in]."""
    t, n_in, n_out = 5, 6, 4
    x = rng.standard_normal((t, n_in))
    w = rng.standard_normal((n_out, n_in))
    r = rng.standard_normal((t, n_out))
    loss = lambda: float(np.sum(linear_fwd(x, w) * r))  # noqa: E731
    dx, dw = linear_bwd(x, w, r)
    assert_grad_close(dx, numeric_grad(loss, x), "linear dx")
    assert_grad_close(dw, numeric_grad(loss, w), "linear dw")


def test_rope_bwd_matches_finite_differences(rng):
    """rope_bwd is the exact transpose of the rotation rope_fwd applies at each position."""
    t, heads, e, theta = 5, 3, 8, 10000.0
    x = rng.standard_normal((t, heads, e))
    positions = rng.integers(0, 5000, size=t)
    r = rng.standard_normal((t, heads, e))
    loss = lambda: float(np.sum(rope_fwd(x, positions, theta) * r))  # noqa: E731
    dx = rope_bwd(r, positions, theta)
    assert_grad_close(dx, numeric_grad(loss, x), "rope dx")


def test_swiglu_bwd_matches_finite_differences(rng):
    """swiglu_bwd gives dgate and dup of silu(gate) * up, including large negative gates."""
    t, f = 4, 7
    gate = rng.standard_normal((t, f)) * 4.0
    up_ = rng.standard_normal((t, f))
    r = rng.standard_normal((t, f))
    loss = lambda: float(np.sum(swiglu_fwd(gate, up_) * r))  # noqa: E731
    np.testing.assert_allclose(swiglu_fwd(gate, up_), gate / (1 + np.exp(-gate)) * up_,
                               rtol=ROUNDING_REL_BOUND)
    dgate, dup = swiglu_bwd(gate, up_, r)
    assert_grad_close(dgate, numeric_grad(loss, gate), "swiglu dgate")
    assert_grad_close(dup, numeric_grad(loss, up_), "swiglu dup")


# --- attention ---------------------------------------------------------------------------------


def direct_attention(q, k, v, q_offset):
    """Plain float64 causal GQA attention: repeat kv heads, mask keys after each query's
    position, softmax. -> o (T, H, E), lse (H, T)."""
    t, h, e = q.shape
    s, kh, _ = k.shape
    kr = np.repeat(k, h // kh, axis=1)  # (S, H, E): query head j reads kv head j // group
    vr = np.repeat(v, h // kh, axis=1)
    scores = np.einsum("thd,shd->hts", q, kr) / np.sqrt(e)
    qpos = q_offset + np.arange(t)
    scores = np.where(np.arange(s)[None, None, :] > qpos[None, :, None], -np.inf, scores)
    mx = scores.max(axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(scores - mx), axis=-1)) + mx[..., 0]
    p = np.exp(scores - lse[..., None])
    return np.einsum("hts,shd->thd", p, vr), lse


@pytest.mark.parametrize("t, s, q_offset", [(5, 5, 0), (4, 9, 5), (3, 9, 2)],
                         ids=["whole-sequence", "chunk-continues-sequence", "keys-after-chunk"])
def test_attention_bwd_matches_finite_differences(rng, t, s, q_offset):
    """attention_bwd's dq, dk, dv match finite differences for causal GQA, including a query
    chunk at an offset whose dk, dv cover the whole context (keys after the chunk get zero)."""
    h, kh, e = 4, 2, 4
    q = rng.standard_normal((t, h, e))
    k = rng.standard_normal((s, kh, e))
    v = rng.standard_normal((s, kh, e))
    r = rng.standard_normal((t, h, e))
    loss = lambda: float(np.sum(attention_fwd(q, k, v, q_offset)[0] * r))  # noqa: E731
    o, lse = attention_fwd(q, k, v, q_offset)
    o_ref, lse_ref = direct_attention(q, k, v, q_offset)
    np.testing.assert_allclose(o, o_ref, rtol=ROUNDING_REL_BOUND, atol=ROUNDING_REL_BOUND)
    np.testing.assert_allclose(lse, lse_ref, rtol=ROUNDING_REL_BOUND)
    dq, dk, dv = attention_bwd(q, k, v, o, lse, r, q_offset)
    assert dk.shape == (s, kh, e) and dv.shape == (s, kh, e)
    assert_grad_close(dq, numeric_grad(loss, q), "attention dq")
    assert_grad_close(dk, numeric_grad(loss, k), "attention dk")
    assert_grad_close(dv, numeric_grad(loss, v), "attention dv")
    after = np.arange(s) >= q_offset + t  # keys no query of the chunk may see
    assert np.all(dk[after] == 0.0) and np.all(dv[after] == 0.0)


def test_attention_over_whole_sequence_equals_chunkwise_attention_with_offsets(rng):
    """Splitting a sequence into query chunks that attend to the KV of all earlier tokens (with
    q_offset) gives the whole sequence's outputs, lse and, summed over chunks, its dk and dv."""
    s, h, kh, e = 12, 4, 2, 8
    q = rng.standard_normal((s, h, e))
    k = rng.standard_normal((s, kh, e))
    v = rng.standard_normal((s, kh, e))
    do = rng.standard_normal((s, h, e))
    o, lse = attention_fwd(q, k, v)
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do)
    bounds = [0, 4, 9, 12]
    o_parts, lse_parts, dq_parts = [], [], []
    dk_sum, dv_sum = np.zeros_like(dk), np.zeros_like(dv)
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        oc, lc = attention_fwd(q[c0:c1], k[:c1], v[:c1], q_offset=c0)
        dqc, dkc, dvc = attention_bwd(q[c0:c1], k[:c1], v[:c1], oc, lc, do[c0:c1], q_offset=c0)
        o_parts.append(oc)
        lse_parts.append(lc)
        dq_parts.append(dqc)
        dk_sum[:c1] += dkc
        dv_sum[:c1] += dvc
    tol = dict(rtol=ROUNDING_REL_BOUND, atol=ROUNDING_REL_BOUND)
    np.testing.assert_allclose(np.concatenate(o_parts), o, **tol)
    np.testing.assert_allclose(np.concatenate(lse_parts, axis=1), lse, **tol)
    np.testing.assert_allclose(np.concatenate(dq_parts), dq, **tol)
    np.testing.assert_allclose(dk_sum, dk, **tol)
    np.testing.assert_allclose(dv_sum, dv, **tol)


def test_attention_gqa_equals_mha_with_repeated_kv_heads(rng):
    """GQA equals multi-head attention on kv heads repeated per group; its dk, dv are the MHA
    gradients summed over each group of query heads."""
    t, h, kh, e = 6, 6, 2, 4
    q = rng.standard_normal((t, h, e))
    k = rng.standard_normal((t, kh, e))
    v = rng.standard_normal((t, kh, e))
    do = rng.standard_normal((t, h, e))
    o, lse = attention_fwd(q, k, v)
    _, dk, dv = attention_bwd(q, k, v, o, lse, do)
    k_rep, v_rep = np.repeat(k, h // kh, axis=1), np.repeat(v, h // kh, axis=1)
    o_mha, lse_mha = attention_fwd(q, k_rep, v_rep)
    _, dk_mha, dv_mha = attention_bwd(q, k_rep, v_rep, o_mha, lse_mha, do)
    tol = dict(rtol=ROUNDING_REL_BOUND, atol=ROUNDING_REL_BOUND)
    np.testing.assert_allclose(o, o_mha, **tol)
    np.testing.assert_allclose(dk, dk_mha.reshape(t, kh, h // kh, e).sum(axis=2), **tol)
    np.testing.assert_allclose(dv, dv_mha.reshape(t, kh, h // kh, e).sum(axis=2), **tol)


def test_attention_refuses_query_chunk_outside_the_context(rng):
    """A query chunk that would reach past the last key is refused with both extents named."""
    q = rng.standard_normal((4, 2, 4))
    k = rng.standard_normal((6, 1, 4))
    with pytest.raises(ValueError, match=r"\[3, 7\).*6 keys"):
        attention_fwd(q, k, k, q_offset=3)


# --- head + cross-entropy ----------------------------------------------------------------------


def _targets_with_ignored(rng, t, vocab):
    targets = rng.integers(0, vocab, size=t)
    targets[rng.permutation(t)[: max(1, t // 3)]] = IGNORE
    return targets


def direct_cross_entropy(x, w, targets):
    """Sum over non-ignored tokens of logsumexp(x @ w.T) - logit[target], from full logits."""
    logits = x @ w.T
    valid = targets != IGNORE
    mx = logits.max(axis=1)
    lse = mx + np.log(np.sum(np.exp(logits - mx[:, None]), axis=1))
    rows = np.nonzero(valid)[0]
    return float(np.sum(lse[rows] - logits[rows, targets[rows]])), int(rows.size)


def test_head_loss_sum_matches_full_logits_cross_entropy_skipping_ignored(rng):
    """loss_sum and n_valid equal a direct full-logits cross-entropy over non-ignored targets."""
    t, d, vocab = 11, 6, 13
    x = rng.standard_normal((t, d))
    w = rng.standard_normal((vocab, d))
    targets = _targets_with_ignored(rng, t, vocab)
    loss_sum, n_valid, _, _ = head_loss_fwd_bwd(x, w, targets, sub_tokens=4)
    ref_sum, ref_n = direct_cross_entropy(x, w, targets)
    assert n_valid == ref_n
    assert abs(loss_sum - ref_sum) <= ROUNDING_REL_BOUND * abs(ref_sum)


def test_head_loss_grads_match_finite_differences(rng):
    """dx and dw of head_loss_fwd_bwd are the gradients of grad_scale * loss_sum, with ignored
    targets contributing nothing (their rows of dx are zero)."""
    t, d, vocab = 7, 5, 11
    x = rng.standard_normal((t, d))
    w = rng.standard_normal((vocab, d))
    targets = _targets_with_ignored(rng, t, vocab)
    grad_scale = float(rng.uniform(0.1, 2.0))
    loss = lambda: grad_scale * head_loss_fwd_bwd(x, w, targets, sub_tokens=3)[0]  # noqa: E731
    _, _, dx, dw = head_loss_fwd_bwd(x, w, targets, sub_tokens=3, grad_scale=grad_scale)
    assert_grad_close(dx, numeric_grad(loss, x), "head dx")
    assert_grad_close(dw, numeric_grad(loss, w), "head dw")
    assert np.all(dx[targets == IGNORE] == 0.0)


def test_head_loss_does_not_depend_on_sub_tokens_beyond_rounding(rng):
    """Sub-chunking the tokens (1, 3, all, more than all) changes loss, dx and dw only by
    float64 summation-order rounding."""
    t, d, vocab = 10, 6, 17
    x = rng.standard_normal((t, d))
    w = rng.standard_normal((vocab, d))
    targets = _targets_with_ignored(rng, t, vocab)
    ref = head_loss_fwd_bwd(x, w, targets, sub_tokens=t, grad_scale=0.5)
    for sub in (1, 3, t + 5):
        loss_sum, n_valid, dx, dw = head_loss_fwd_bwd(x, w, targets, sub_tokens=sub,
                                                      grad_scale=0.5)
        assert n_valid == ref[1]
        assert abs(loss_sum - ref[0]) <= ROUNDING_REL_BOUND * abs(ref[0])
        assert rel_err(dx, ref[2]) <= ROUNDING_REL_BOUND
        assert rel_err(dw, ref[3]) <= ROUNDING_REL_BOUND


def test_head_loss_refuses_nonpositive_sub_tokens(rng):
    """sub_tokens <= 0 is refused and the bad value is named."""
    x = rng.standard_normal((3, 4))
    with pytest.raises(ValueError, match="got 0"):
        head_loss_fwd_bwd(x, rng.standard_normal((5, 4)), np.array([0, 1, 2]), sub_tokens=0)


# --- AdamW -------------------------------------------------------------------------------------


def adamw_float64(p, g, m, v, *, step, lr, b1, b2, eps, wd, grad_scale):
    """Hand-written AdamW (Loshchilov & Hutter) in float64: bias-corrected moments and weight
    decay applied to the parameter directly, never through the gradient or the moments."""
    g = g * grad_scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    m_hat = m / (1 - b1**step)
    v_hat = v / (1 - b2**step)
    p = p * (1 - lr * wd) - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


def test_adamw_matches_float64_formula_over_several_steps(rng):
    """Three float64 AdamW steps equal the hand-written formula, bias correction and decoupled
    weight decay included."""
    n = 50
    hp = dict(lr=float(rng.uniform(1e-3, 1e-1)), b1=0.9, b2=0.95, eps=1e-8,
              wd=float(rng.uniform(0.01, 0.2)))
    p = rng.standard_normal(n)
    m, v = np.zeros(n), np.zeros(n)
    p_ref, m_ref, v_ref = p.copy(), m.copy(), v.copy()
    for step in (1, 2, 3):
        g = rng.standard_normal(n)
        scale = float(rng.uniform(0.2, 2.0))
        adamw_step(p, g, m, v, step=step, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"],
                   eps=hp["eps"], weight_decay=hp["wd"], grad_scale=scale)
        p_ref, m_ref, v_ref = adamw_float64(p_ref, g, m_ref, v_ref, step=step, grad_scale=scale,
                                            **hp)
    for got, want in ((p, p_ref), (m, m_ref), (v, v_ref)):
        np.testing.assert_allclose(got, want, rtol=ROUNDING_REL_BOUND, atol=0)


def test_adamw_first_step_moves_each_param_by_lr_times_sign_of_grad(rng):
    """With zero moments and no decay, bias correction makes the first update lr * g/(|g|+eps)."""
    p = rng.standard_normal(20)
    g = rng.standard_normal(20)
    p0 = p.copy()
    adamw_step(p, g, np.zeros(20), np.zeros(20), step=1, lr=0.01, eps=1e-8)
    np.testing.assert_allclose(p0 - p, 0.01 * g / (np.abs(g) + 1e-8), rtol=ROUNDING_REL_BOUND)


def test_adamw_weight_decay_is_decoupled_from_the_gradient(rng):
    """Weight decay shrinks p by lr * wd * p and leaves the moments as without decay."""
    n, lr, wd = 30, 0.05, 0.1
    p = rng.standard_normal(n)
    p_zero_grad = p.copy()
    adamw_step(p_zero_grad, np.zeros(n), np.zeros(n), np.zeros(n), step=1, lr=lr,
               weight_decay=wd)
    np.testing.assert_allclose(p_zero_grad, p * (1 - lr * wd), rtol=ROUNDING_REL_BOUND)
    g = rng.standard_normal(n)
    m_wd, v_wd, m_0, v_0 = (np.zeros(n) for _ in range(4))
    p_wd, p_0 = p.copy(), p.copy()
    adamw_step(p_wd, g, m_wd, v_wd, step=1, lr=lr, weight_decay=wd)
    adamw_step(p_0, g, m_0, v_0, step=1, lr=lr, weight_decay=0.0)
    assert np.array_equal(m_wd, m_0) and np.array_equal(v_wd, v_0)
    np.testing.assert_allclose(p_wd - p_0, -lr * wd * p, rtol=1e-9, atol=1e-15)


def test_adamw_refuses_step_zero(rng):
    """Steps count from 1 (bias correction would divide by zero at 0); 0 is refused."""
    p = rng.standard_normal(4)
    with pytest.raises(ValueError, match="got 0"):
        adamw_step(p, p.copy(), np.zeros(4), np.zeros(4), step=0, lr=0.1)
