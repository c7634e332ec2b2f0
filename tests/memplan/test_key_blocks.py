"""Key blocks of a long context's attention backward (dataflow.memplan.plan.buffers): the spans the CUDA op
table runs cover exactly the keys a chunk sees, once each, none longer than a block, and the
planner's scratch shrinks with them."""

from __future__ import annotations

import pytest

from dataflow.memplan.plan import buffers
from dataflow.models.config import load_config


@pytest.mark.parametrize("q_offset,n_q,block", [(0, 256, 512), (256, 256, 512), (1792, 256, 512),
                                                 (1000, 300, 512), (5 * 8192, 8192, 49152), (7, 5, 5)])
def test_spans_cover_the_visible_keys_once_and_fit_a_block(q_offset, n_q, block):
    spans = buffers.key_block_spans(q_offset, n_q, block)
    end = q_offset + n_q
    assert spans[0][2] and all(not causal for _, _, causal in spans[1:])
    assert spans[0] == (q_offset, end, True)  # the diagonal alone carries the mask
    covered = sorted((a, b) for a, b, _ in spans)
    assert covered[0][0] == 0 and all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert covered[-1][1] == end and all(0 < b - a <= max(block, n_q) for a, b in covered)


def test_a_block_shorter_than_the_chunk_is_refused():
    with pytest.raises(ValueError, match="shorter than the 5 queries"):
        buffers.key_block_spans(7, 5, 4)


def test_long_contexts_get_blocks_and_smaller_scratch():
    cfg = load_config("1b")
    short = buffers.attention_key_block(cfg, 8192, 65536)
    long = buffers.attention_key_block(cfg, 8192, 1 << 20)
    assert short == 65536 and long < 1 << 20 and long % 8192 == 0
    names = {s.name: s for s in buffers.context_specs(cfg, 1 << 20, 8192, 128)}
    assert names["dk16"].shape[0] == long and "dq32" in names
    # every split sequence takes its chunks' backward in spans (the mask on the chunk's own
    # keys only), which sum dQ in fp32; a packed chunk is one call
    assert "dq32" in {s.name for s in buffers.context_specs(cfg, 65536, 8192, 8)}
    assert "dq32" not in {s.name for s in buffers.context_specs(cfg, 8192, 8192, 1)}
    assert buffers.attention_workspace_bytes(cfg, 8192, 1 << 20) < 2 << 30
