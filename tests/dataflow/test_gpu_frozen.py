"""Frozen blocks on the GPU (CuPy backend; issue 54, first step): the frozen plans of
tests/dataflow/test_frozen.py train on the GPU with the NumPy backend's losses and updates
(frozen blocks bit-identical to their initial weights: rms_norm_bwd and head_loss_fwd_bwd
without a weight gradient, no weight-gradient GEMM), and a frozen layer's backward leaves the
CUDA kernels' dx equal to the one the same layer forms when it trains. Not run on the CPU
machine of the session that wrote it: it needs a GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.backends import make_backend  # noqa: E402
from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.models.init import init_model  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from tests.dataflow.test_frozen import CASES, _plan  # noqa: E402

LR = 1e-3


def _run(plan, backend: str, seed: int = 54):
    ch, cfg = plan.chunking, plan.model
    with Engine.from_plan(plan, backend=backend, seed=seed,
                          optimizer=AdamWConfig(lr=LR, max_grad_norm=1.0)) as eng:
        losses = []
        for s in range(3):
            batch = token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                 start=1 + seed * 7919 + s * ch.seqs_per_step * ch.seqlen)
            losses.append(eng.train_step(batch).loss)
        w = eng.weights()
    return losses, [w.embed, *w.layers, w.head]


@pytest.mark.parametrize("name,spec", CASES)
def test_gpu_frozen_plans_match_the_numpy_backend(name, spec):
    """Losses within 2e-2 relative and every trained block's three-step update within 10 %
    (relative L2) of the NumPy backend's; frozen blocks equal their initial bits on both."""
    plan = _plan(name, spec)
    g_loss, g_w = _run(plan, "cupy")
    n_loss, n_w = _run(plan, "numpy")
    np.testing.assert_allclose(g_loss, n_loss, rtol=2e-2, err_msg=f"{name} {spec}")
    start = init_model(plan.model, 54)
    f = plan.frozen
    trains = [not f.embed] + [not f.layer(i) for i in range(plan.model.n_layers)] + [not f.head]
    for i, (a, b, s, t) in enumerate(zip(g_w, n_w, [start.embed, *start.layers, start.head],
                                         trains)):
        if not t:
            assert np.array_equal(a.view(np.uint16), s.view(np.uint16)), (name, spec, i)
            assert np.array_equal(b.view(np.uint16), s.view(np.uint16)), (name, spec, i)
            continue
        da = a.astype(np.float64) - s.astype(np.float64)
        db = b.astype(np.float64) - s.astype(np.float64)
        err = np.linalg.norm(da - db) / np.linalg.norm(db)
        assert err < 0.10, f"{name} {spec} block {i}: update differs from NumPy by {err:.2%}"


def test_gpu_frozen_norm_and_head_kernels_form_dx_alone(rng):
    """rms_norm_bwd and head_loss_fwd_bwd with no weight gradient write the same dx (and loss)
    bits as with one, on fresh random bf16 inputs."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    be = make_backend("cupy")
    try:
        t, d, v = 256, 128, 512

        def bf(shape, scale=1.0):
            return cp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)
                              .astype(bf16))

        x, w, dy = bf((t, d)), bf((d,)), bf((t, d))
        rstd = cp.asarray((1.0 / np.sqrt((cp.asnumpy(x).astype(np.float32) ** 2).mean(1)
                                         + 1e-5)).astype(np.float32))
        dx1, dx2, dw = cp.empty((t, d), bf16), cp.empty((t, d), bf16), cp.zeros((d,), np.float32)
        be.ops.rms_norm_bwd(x, w, rstd, dy, dx1, dw)
        be.ops.rms_norm_bwd(x, w, rstd, dy, dx2, None)
        be.synchronize()
        assert cp.array_equal(dx1.view(cp.uint16), dx2.view(cp.uint16))
        hw = bf((v, d), 0.05)
        targets = cp.asarray(rng.integers(0, v, t).astype(np.int32))
        logits = cp.empty((64, v), np.float32)
        outs = []
        for dwh in (cp.zeros((v, d), np.float32), None):
            dxh, acc = cp.empty((t, d), bf16), cp.zeros((2,), np.float32)
            be.ops.head_loss_fwd_bwd(x, hw, targets, logits, 1.0 / t, dxh, dwh, acc)
            be.synchronize()
            outs.append((dxh, acc))
        assert cp.array_equal(outs[0][0].view(cp.uint16), outs[1][0].view(cp.uint16))
        assert cp.array_equal(outs[0][1], outs[1][1])
    finally:
        be.close()
