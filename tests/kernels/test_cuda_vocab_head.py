"""The vocabulary-parallel head's four CUDA ops (dataflow.ops_cuda.CudaOps: vocab_stats,
vocab_merge, vocab_loss, vocab_grad over kernels/cuda/head_vocab) against their NumPy ops
(dataflow.ops_numpy, over kernels/reference/head_vocab) on fresh random inputs: shards of 500
rows (the float4 path) and 499 rows from row 501 (the scalar path), targets on and off the
shard and a fifth IGNORE, sub-chunks of 128 tokens over 300 (the last partial). Tolerance rule
of tests/kernels/test_cuda_ops.py (STYLE §7): truth in float64, the bf16 reference is the NumPy
op (for vocab_grad, with the dlogits rounded to bf16 before the GEMMs, as the fast path rounds
them by design, like head_loss_fwd_bwd). Outputs are NaN-poisoned. GPU only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.gpu import require_gpu

cp = require_gpu()

from dataflow import ops_numpy  # noqa: E402
from dataflow.kernels.reference import head_vocab as ref_vocab  # noqa: E402
from dataflow.kernels.reference.head_loss import IGNORE  # noqa: E402
from dataflow.ops_cuda import CudaOps  # noqa: E402
from tests.gpu import (BF16, F32, bf, check_close, cuda_context, dev, f64,  # noqa: E402
                       host, poisoned)

pytestmark = pytest.mark.gpu
OPS = CudaOps(cuda_context())
T, D, V, SUB = 300, 256, 1000, 128
SHARDS = [(0, 500), (501, 499)]
"""(row0, rows) of the shards tested: float4 loads, then the scalar path off a row boundary."""


def _inputs(rng):
    x = bf(rng.standard_normal((T, D)))
    w = bf(rng.standard_normal((V, D)) / math.sqrt(D) * 2.0)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[rng.random(T) < 0.2] = IGNORE
    return x, w, targets


def _random_stats(rng) -> np.ndarray:
    """Plausible statistics (T, 3) fp32: max, a positive sum of exps, a target logit or 0."""
    s = np.empty((T, 3), F32)
    s[:, 0] = rng.standard_normal(T) * 3
    s[:, 1] = np.exp(rng.standard_normal(T)) * 50 + 1
    s[:, 2] = np.where(rng.random(T) < 0.5, rng.standard_normal(T) * 3, 0.0)
    return s


@pytest.mark.parametrize("row0,rows", SHARDS)
def test_vocab_stats_cuda_matches_the_numpy_op(rng, row0, rows):
    """Each column of the shard's statistics within the bf16 bound of the NumPy op."""
    x, w, targets = _inputs(rng)
    ws = w[row0:row0 + rows]
    truth = ref_vocab.shard_stats(f64(x), f64(ws), targets, row0, sub_tokens=SUB)
    want = np.full((T, 3), np.nan, F32)
    ops_numpy.vocab_stats(x, ws, targets, row0, np.empty((SUB, rows), F32), want)
    stats = poisoned((T, 3), F32)
    OPS.vocab_stats(dev(x), dev(ws), dev(targets), row0, poisoned((SUB, rows), F32), stats)
    got = host(stats)
    mine = (targets != IGNORE) & (targets >= row0) & (targets < row0 + rows)
    assert np.array_equal(got[:, 2] == 0, ~mine) and mine.any() and (~mine).any()
    for c, what in enumerate(("max", "sum exp", "target logit")):
        check_close(f"vocab_stats {what} rows={rows}", got[:, c], truth[:, c], want[:, c])


def test_vocab_merge_cuda_matches_the_numpy_op(rng):
    """The merge of two random statistics, in place on the first, within the bound."""
    a, b = _random_stats(rng), _random_stats(rng)
    truth = ref_vocab.merge_stats(f64(a), f64(b))
    want = a.copy()
    ops_numpy.vocab_merge(want, b)
    acc = dev(a)
    OPS.vocab_merge(acc, dev(b))
    got = host(acc)
    assert np.array_equal(got[:, 0], np.maximum(a[:, 0], b[:, 0]))
    for c, what in enumerate(("max", "sum exp", "target logit")):
        check_close(f"vocab_merge {what}", got[:, c], truth[:, c], want[:, c])


def test_vocab_loss_cuda_matches_the_numpy_op(rng):
    """loss_acc += [loss over the tokens not ignored, their count]: the count exact."""
    stats = _random_stats(rng)
    _, _, targets = _inputs(rng)
    _, truth, n = ref_vocab.stats_loss(f64(stats), targets)
    want = np.array([0.25, 3.0], F32)
    ops_numpy.vocab_loss(stats, targets, want)
    acc = dev(np.array([0.25, 3.0], F32))
    OPS.vocab_loss(dev(stats), dev(targets), acc)
    got = host(acc)
    assert got[1] - 3.0 == n == np.count_nonzero(targets != IGNORE)
    check_close("vocab_loss", np.array([got[0] - 0.25]), np.array([truth]),
                np.array([want[0] - 0.25]))


def _grad_bf16_pipeline(x, ws, targets, row0, stats, grad_scale, dw0):
    """The NumPy op's sums in fp32 with the dlogits rounded to bf16 before the GEMMs and dw
    rounded to its dtype after each sub-chunk (the fast path's beta = 1 accumulation)."""
    xf, wf = x.astype(F32), ws.astype(F32)
    lse = stats[:, 0] + np.log(stats[:, 1])
    dx, dw = np.empty(x.shape, F32), dw0.copy()
    for t0 in range(0, T, SUB):
        xs, tg = xf[t0:t0 + SUB], targets[t0:t0 + SUB]
        p = np.exp(xs @ wf.T - lse[t0:t0 + SUB, None])
        mine = np.nonzero((tg != IGNORE) & (tg >= row0) & (tg < row0 + ws.shape[0]))[0]
        p[mine, tg[mine] - row0] -= 1.0
        p[tg == IGNORE] = 0.0
        dl = bf(p * F32.type(grad_scale)).astype(F32)
        dx[t0:t0 + SUB] = dl @ wf
        dw = (dw.astype(F32) + dl.T @ xs).astype(dw0.dtype)
    return dx, dw


@pytest.mark.parametrize("row0,rows", SHARDS)
@pytest.mark.parametrize("dw_dtype", [F32, BF16])
def test_vocab_grad_cuda_matches_the_numpy_op(rng, row0, rows, dw_dtype):
    """The shard's fp32 partial dx (written) and its rows' dw (accumulated onto random
    values) from the whole vocabulary's merged statistics, within the bound."""
    x, w, targets = _inputs(rng)
    ws, grad_scale = w[row0:row0 + rows], 1.0 / T
    stats64 = ref_vocab.shard_stats(f64(x), f64(w), targets, 0, sub_tokens=SUB)
    stats = stats64.astype(F32)
    lse64 = stats64[:, 0] + np.log(stats64[:, 1])
    dx_t, dw_t = ref_vocab.shard_bwd(f64(x), f64(ws), targets, row0, lse64, sub_tokens=SUB,
                                     grad_scale=grad_scale)
    dw0 = (rng.standard_normal((rows, D)) * 1e-3).astype(dw_dtype)
    dx_r, dw_r = _grad_bf16_pipeline(x, ws, targets, row0, stats, grad_scale, dw0)
    dx_np, dw_np = np.full((T, D), np.nan, F32), dw0.astype(F32)
    ops_numpy.vocab_grad(x, ws, targets, row0, stats, np.empty((SUB, rows), F32), grad_scale,
                         dx_np, dw_np)
    assert np.all(np.isfinite(dx_np))  # the NumPy op ran on the same arguments
    dx, dw = poisoned((T, D), F32), dev(dw0)
    OPS.vocab_grad(dev(x), dev(ws), dev(targets), row0, dev(stats), poisoned((SUB, rows), F32),
                   grad_scale, dx, dw)
    check_close(f"vocab_grad dx rows={rows}", host(dx), dx_t, dx_r)
    check_close(f"vocab_grad dw {dw_dtype} rows={rows}", host(dw), f64(dw0) + dw_t, dw_r)
    check_close(f"vocab_grad dx numpy rows={rows}", dx_np, dx_t, dx_r)
