"""The fast fused-attention backward on the GPU (Plan.attention_bwd = fast): a plan that does not
reserve the deterministic workspace makes the op table take cuDNN's atomic-dQ backward for
packed chunks, with nothing allocated outside the arena, and trains to the same losses as the
deterministic plan within bf16 noise (step 1's loss, before any update, is identical)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from dataflow.memplan import make_plan  # noqa: E402
from dataflow.memplan.plan.plan import AttentionBwd, Budget  # noqa: E402
from dataflow.memplan.plan.profiles import get_profile  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402


SEQLEN = 2048
"""Long enough that the deterministic workspace (2*T*T*H) exceeds the fast plan's region."""


def _losses(attention_bwd: str) -> tuple[list[float], int | None]:
    cfg = load_config("small")
    plan = make_plan(cfg, SEQLEN, Budget.from_gib(4, 2), get_profile("h100"),
                     attention_bwd=attention_bwd)
    assert plan.attention_bwd is AttentionBwd(attention_bwd)
    assert plan.chunking.chunks_per_seq == 1  # packed: each sequence attends to itself
    ch = plan.chunking
    with Engine.from_plan(plan, backend="cupy", optimizer=AdamWConfig(lr=1e-3)) as eng:
        losses = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                              start=s * ch.seqs_per_step * ch.seqlen)).loss
                  for s in range(3)]
        report = eng.be.memory_report()
        ws = eng.be.ops.attention_workspace_nbytes()
    assert report["op_scratch_bytes"] == 0 and report["cudnn_workspace_bytes"] == 0
    return losses, ws


def test_fast_backward_trains_like_the_deterministic_one(monkeypatch):
    monkeypatch.setenv("DATAFLOW_ALLOC_GUARD", "error")
    from dataflow.kernels import cuda as K
    from tests.gpu import cuda_context

    det, det_ws = _losses("deterministic")  # each engine's backend starts with no cuDNN graph
    fast, fast_ws = _losses("fast")
    cfg = load_config("small")
    ctx = cuda_context()
    need = K.attention_workspace_bytes(ctx, "bwd", SEQLEN, cfg.n_heads, cfg.n_kv_heads,
                                       cfg.head_dim, 0, deterministic=True)
    ctx.close()
    assert fast_ws < need <= det_ws  # so the fast run could only take the atomic-dQ backward
    assert fast[0] == det[0]
    np.testing.assert_allclose(fast, det, rtol=2e-2)
