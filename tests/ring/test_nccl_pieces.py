"""The NCCL transport's split-update arithmetic that needs no GPU: the pieces a pinned host
view's reduce-scatter passes the staging buffer in (ring.nccl.part_pieces) and the bounds check
both transports share (ring.transport.check_part_bounds). The NCCL calls themselves:
tests/ring/test_ring_gpu.py (one GPU, a 1-rank communicator; two GPUs, split against unsplit)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dataflow.ring.nccl import part_pieces
from dataflow.ring.transport import RingError, check_part_bounds


@pytest.mark.parametrize("bounds,step", [((0, 10, 10, 30), 4), ((0, 4096, 8192), 4096),
                                         ((0, 2, 6, 100, 102), 6), ((0, 0), 8)])
def test_pieces_cover_each_part_in_order_within_the_staging_buffer(bounds, step):
    """Every byte of every part once, in order, no piece longer than the buffer or across a
    part's end; an empty part has no piece (every replica skips it alike)."""
    pieces = part_pieces(bounds, step)
    covered = [b for _, lo, hi in pieces for b in range(lo, hi)]
    assert covered == list(range(bounds[-1]))
    for q, lo, hi in pieces:
        assert bounds[q] <= lo < hi <= bounds[q + 1] and hi - lo <= step
    assert [q for q, _, _ in pieces] == sorted(q for q, _, _ in pieces)


def test_reduce_scatter_through_pieces_leaves_each_replica_its_summed_part(rng):
    """Three replicas' host bf16 gradients through the pieces as the transport moves them (each
    piece summed over the replicas, written back on its part's replica only): replica q's part
    is the fp32 sum rounded once, every other byte is as it was."""
    r, n, step = 3, 1001, 2 * 97
    grads = [rng.standard_normal(n).astype(ml_dtypes.bfloat16) for _ in range(r)]
    bounds = (0, 2 * 300, 2 * 301, 2 * n)
    out = [g.copy() for g in grads]
    for q, lo, hi in part_pieces(bounds, step):
        a, b = lo // 2, hi // 2
        total = sum(g[a:b].astype(np.float32) for g in grads).astype(ml_dtypes.bfloat16)
        out[q][a:b] = total
    whole = sum(g.astype(np.float32) for g in grads).astype(ml_dtypes.bfloat16)
    for q in range(r):
        mine = slice(bounds[q] // 2, bounds[q + 1] // 2)
        assert np.array_equal(out[q][mine].view(np.uint16), whole[mine].view(np.uint16))
        rest = np.ones(n, bool)
        rest[mine] = False
        assert np.array_equal(out[q][rest].view(np.uint16), grads[q][rest].view(np.uint16))


@pytest.mark.parametrize("bounds", [(0, 6), (0, 4, 6, 9), (2, 4, 8), (0, 6, 4, 8), (0, 3, 8)])
def test_part_bounds_that_do_not_cut_the_view_are_refused_by_name(bounds):
    view = np.zeros(4, np.float16)  # 8 bytes of 2-byte elements
    with pytest.raises(RingError, match=r"part bounds .* do not cut 8 bytes of 2-byte"):
        check_part_bounds(view, bounds, 2, 0)
    assert check_part_bounds(view, (0, 2, 8), 2, 0) == (0, 2, 8)
