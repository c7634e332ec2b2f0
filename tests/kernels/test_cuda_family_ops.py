"""The CUDA side of Qwen2's q/k/v biases and Qwen3's QK-norm, against the NumPy references on
fresh random bf16 inputs (tolerance rule of test_cuda_ops: at most twice the bf16 reference's
error against float64): bias_fill is an exact row copy and, followed by an accumulating
linear_fwd, is linear_fwd(x, w, b); bias_bwd is the column sum, the same bits run to run; the
RMSNorm kernels over rows of head_dim are QK-norm's forward and backward; and the executor on the
CuPy backend trains both families as the NumPy backend does. GPU only.

    python -m pytest -q -m gpu tests/kernels/test_cuda_family_ops.py"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cupy = require_gpu()

import dataflow.kernels.cuda as kc  # noqa: E402
import dataflow.kernels.reference as ref  # noqa: E402
from tests.gpu import (BF16, F32, bf, check_close, cuda_context, dev, f64, host,  # noqa: E402
                       poisoned)

CTX = cuda_context()
"""The CudaContext every kernel call of this module launches through."""


def test_bias_fill_then_accumulating_linear_is_the_biased_linear(rng):
    """y = bias on every row (exact), then x @ w.T accumulated onto it in fp32: Qwen2's biased
    q/k/v projection, rounded once, as the reference's linear_fwd(x, w, b)."""
    t, i, o = 333, 256, 96
    x, w = bf(rng.standard_normal((t, i))), bf(rng.standard_normal((o, i)) / 16)
    b = bf(rng.standard_normal(o))
    y = poisoned((t, o), BF16)
    kc.bias_fill(CTX, dev(b), y)
    assert np.array_equal(host(y).view(np.uint16), np.broadcast_to(b, (t, o)).view(np.uint16))
    kc.linear_fwd(CTX, dev(x), dev(w), y, True)
    truth = f64(x) @ f64(w).T + f64(b)
    check_close("linear_fwd + bias", host(y), truth, ref.linear_fwd(x, w, b))


@pytest.mark.parametrize("db_dtype", [BF16, F32])
def test_bias_bwd_is_the_column_sum_and_deterministic(rng, db_dtype):
    """db += sum over rows of dy, for ragged column counts; the same bits twice."""
    t, o = 1029, 200
    dy = bf(rng.standard_normal((t, o)))
    db0 = rng.standard_normal(o).astype(db_dtype)
    runs = []
    for _ in range(2):
        db = dev(db0)
        kc.bias_bwd(CTX, dev(dy), db)
        runs.append(host(db))
    assert np.array_equal(runs[0].view(np.uint8), runs[1].view(np.uint8))
    truth = f64(db0) + f64(dy).sum(axis=0)
    want = (db0.astype(F32) + ref.bias_bwd(dy)).astype(db_dtype)
    check_close(f"bias_bwd {db_dtype}", runs[0], truth, want)


@pytest.mark.parametrize("heads,head_dim", [(32, 128), (4, 16)])
def test_rms_norm_over_heads_is_qk_norm_forward_and_backward(rng, heads, head_dim):
    """QK-norm as the layer runs it: the (T*H, E) rows of q through rms_norm_fwd into another
    buffer, then rms_norm_bwd with dx written over dy (in place) and dw accumulating."""
    t, e = 77, head_dim
    x = bf(rng.standard_normal((t * heads, e)) * 3)
    w = bf(1 + 0.2 * rng.standard_normal(e))
    dy = bf(rng.standard_normal((t * heads, e)))
    y, rstd = poisoned((t * heads, e), BF16), poisoned(t * heads, F32)
    kc.rms_norm_fwd(CTX, dev(x), dev(w), 1e-6, y, rstd)
    ry, rr = ref.rms_norm_fwd(x, w, 1e-6)
    ty, tr = ref.rms_norm_fwd(f64(x), f64(w), 1e-6)
    check_close("qk_norm fwd", host(y), ty, ry)
    check_close("qk_norm rstd", host(rstd), tr, rr)
    d = dev(dy)
    dw = cupy.zeros(e, F32)
    kc.rms_norm_bwd(CTX, dev(x), dev(w), rstd, d, d, dw)
    rdx, rdw = ref.rms_norm_bwd(x, w, rr, dy)
    tdx, tdw = ref.rms_norm_bwd(f64(x), f64(w), tr, f64(dy))
    check_close("qk_norm bwd dx (in place)", host(d), tdx, rdx)
    check_close("qk_norm bwd dw", host(dw), tdw, rdw)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gpu_executor_trains_qwen_families_as_the_numpy_backend(family):
    """The tiny shape as Qwen2 / Qwen3 on every forced plan: CuPy losses within 2e-2 of the
    NumPy backend's, as test_gpu_executor asks of Llama."""
    from dataflow.data import token_stream
    from dataflow.engine import Engine
    from dataflow.models.config import load_config
    from dataflow.optimizer import AdamWConfig
    from tests.dataflow.plans import path_plans, split_plans

    cfg = dataclasses.replace(load_config("tiny"), name=f"tiny-{family}", family=family,
                              attention_bias=family == "qwen2", qk_norm=family == "qwen3")
    for name, plan in path_plans(cfg)[:3] + split_plans(cfg):
        losses = {}
        for backend in ("cupy", "numpy"):
            ch = plan.chunking
            with Engine.from_plan(plan, backend=backend, optimizer=AdamWConfig(lr=1e-3)) as eng:
                losses[backend] = [eng.train_step(token_stream(
                    ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                    start=s * ch.seqs_per_step * ch.seqlen)).loss for s in range(2)]
        np.testing.assert_allclose(losses["cupy"], losses["numpy"], rtol=2e-2, err_msg=name)
