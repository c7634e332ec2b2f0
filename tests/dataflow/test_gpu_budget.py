"""Budget truth on the GPU: with the allocation guard on (its default, 'error'), a split sequence
with 8 distinct context lengths trains two steps without one CuPy allocation outside the arena,
cuDNN and cuBLAS work in lent arena scratch, and the device memory beyond the arena and the
CUDA context stays small."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from dataflow.memplan.plan.plan import Where  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from dataflow.models.flops import SavedLevel  # noqa: E402
from tests.dataflow.plans import forced_plan  # noqa: E402


@pytest.mark.parametrize("key_block", [None, 512])
def test_split_sequence_with_8_contexts_allocates_nothing_outside_the_arena(monkeypatch,
                                                                             key_block):
    """8 distinct contexts per sequence, with the whole context in one backward call and (512)
    with the key-block backward of long contexts (blocks of 512 keys: up to 4 per call)."""
    monkeypatch.setenv("DATAFLOW_ALLOC_GUARD", "error")
    if key_block is not None:
        from dataflow.memplan.plan import buffers
        cfg = load_config("small")
        per_key = (buffers.ATTN_NONDET_CONTEXT_BYTES + 4) * cfg.kv_dim
        monkeypatch.setattr(buffers, "KEY_BLOCK_TARGET_BYTES", per_key * key_block)
        assert buffers.attention_key_block(cfg, 256, 2048) == key_block
    # The engine's backend starts with no cuDNN graph (its own CudaContext): none that an
    # earlier test ran without a lent workspace can hide a region that is too small.
    cfg = load_config("small")
    n, c = cfg.n_layers, 8
    homes = [[Where.HOME if (l + k) % 2 else Where.DEVICE for k in range(c)] for l in range(n)]
    levels = [[(SavedLevel.FULL, SavedLevel.INP_ATTN, SavedLevel.INP_ONLY)[(l + k) % 3]
               for k in range(c)] for l in range(n)]
    plan = forced_plan(cfg, 2048, chunk_tokens=256, chunks_per_seq=c, chunks_per_round=c,
                       rounds=2, levels=levels, homes=homes, act_slots=2)
    ch = plan.chunking
    with Engine.from_plan(plan, backend="cupy", optimizer=AdamWConfig(lr=1e-3)) as eng:
        for s in range(2):
            eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                        start=s * ch.seqs_per_step * ch.seqlen))
        report = eng.be.memory_report()
    print(report)
    assert report["op_scratch_bytes"] == 0
    assert report["cudnn_workspace_bytes"] == 0
    assert report["libraries_and_pool_bytes"] < 512 << 20
