"""The vocabulary-parallel head's NumPy reference (dataflow.kernels.reference.head_vocab) against
the unsharded head loss, for 2, 3 and 4 shards over vocabularies N does not divide, with ignored
targets. In float64 the shards differ from the whole head only in the order of sums, so the
bound is ROUNDING_REL_BOUND; in fp32 (what a ring runs) the bound is a few fp32 ulps of the
result's norm."""

import numpy as np
import pytest

from dataflow.kernels.reference import head_loss_fwd_bwd
from dataflow.kernels.reference.head_loss import IGNORE
from dataflow.kernels.reference.head_vocab import (merge_stats, shard_rows, shard_stats,
                                                   sharded_head_fwd_bwd)

ROUNDING_REL_BOUND = 1e-12
"""float64: the sharded head differs from one head only in summation order."""
FP32_REL_BOUND = 1e-5
"""fp32: the same, at about 100 fp32 ulps (2^-23 = 1.2e-7) of the norm."""


def rel_err(a, b) -> float:
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / scale) if scale else 0.0


def _inputs(rng, t, d, v, dtype):
    x = rng.standard_normal((t, d)).astype(dtype)
    w = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(dtype)
    targets = rng.integers(0, v, size=t)
    targets[rng.random(t) < 0.2] = IGNORE
    targets[0] = v - 1  # the last shard's last row is a target
    return x, w, targets


def test_shard_rows_cover_any_vocabulary_in_order():
    """The shards' rows are consecutive, cover the vocabulary and differ in size by at most 1."""
    for v in (7, 10, 97, 128256):
        for n in (1, 2, 3, 4, 7):
            spans = [shard_rows(v, n, s) for s in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == v
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1


def test_shard_rows_refuses_more_shards_than_rows():
    """A shard with no rows is refused, naming what would work."""
    with pytest.raises(ValueError, match="n_shards <= vocab_size"):
        shard_rows(3, 4, 0)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("v", [37, 50])
def test_sharded_head_matches_unsharded_in_float64(rng, n, v):
    """Loss, valid count, dx and dw of N shards equal one head's up to summation order."""
    t, d, sub = 19, 12, 8
    x, w, targets = _inputs(rng, t, d, v, np.float64)
    scale = 1.0 / 23
    loss, n_valid, dx, dw = head_loss_fwd_bwd(x, w, targets, sub_tokens=sub, grad_scale=scale)
    loss_s, n_s, dx_s, dw_s = sharded_head_fwd_bwd(x, w, targets, n, sub_tokens=sub,
                                                   grad_scale=scale)
    assert n_s == n_valid == int(np.count_nonzero(targets != IGNORE))
    assert abs(loss_s - loss) <= ROUNDING_REL_BOUND * abs(loss)
    assert rel_err(dx_s, dx) < ROUNDING_REL_BOUND
    assert rel_err(dw_s, dw) < ROUNDING_REL_BOUND
    assert np.all(dx_s[targets == IGNORE] == 0.0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_head_matches_unsharded_in_fp32(rng, n):
    """In fp32, what the NumPy ring computes, the shards stay within FP32_REL_BOUND."""
    t, d, v, sub = 33, 16, 61, 16
    x, w, targets = _inputs(rng, t, d, v, np.float32)
    loss, _, dx, dw = head_loss_fwd_bwd(x, w, targets, sub_tokens=sub, grad_scale=0.5)
    loss_s, _, dx_s, dw_s = sharded_head_fwd_bwd(x, w, targets, n, sub_tokens=sub,
                                                 grad_scale=0.5)
    assert dx_s.dtype == np.float32 and dw_s.dtype == np.float32
    assert abs(loss_s - loss) <= FP32_REL_BOUND * abs(loss)
    assert rel_err(dx_s, dx) < FP32_REL_BOUND
    assert rel_err(dw_s, dw) < FP32_REL_BOUND


def test_merge_is_the_stats_of_the_union(rng):
    """Merging two shards' statistics gives the statistics of their rows together."""
    t, d, v = 9, 6, 20
    x, w, targets = _inputs(rng, t, d, v, np.float64)
    whole = shard_stats(x, w, targets, 0)
    merged = merge_stats(shard_stats(x, w[:7], targets, 0), shard_stats(x, w[7:], targets, 7))
    assert np.allclose(merged, whole, rtol=ROUNDING_REL_BOUND, atol=0)
