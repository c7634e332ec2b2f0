"""The output head and next-token cross-entropy split over the vocabulary: N shards of the lm_head
rows (a ring's vocabulary-parallel head), each of which sees the whole final-normed hidden state
and only its own rows. Per token a shard forms its partial statistics (the max of its logits, the
sum of exp(logit - max) and the target's logit when the target is one of its rows); the shards'
statistics are merged in a fixed order into the log-sum-exp; with it each shard forms its rows'
weight gradient and a partial dx, and the partial dx are summed in a fixed order. Together the
shards give head_loss.head_loss_fwd_bwd's loss and gradients up to the order of fp32 sums.
Never imports our other packages: shapes arrive as plain ints and arrays."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up
from dataflow.kernels.reference.head_loss import IGNORE

STATS = 3
"""Columns of a shard's per-token statistics: max logit, sum of exp(logit - max), target logit
(0 where the target is not one of the shard's rows, or is IGNORE)."""


def shard_rows(vocab_size: int, n_shards: int, shard: int) -> tuple[int, int]:
    """Rows [start, stop) of the lm_head that shard `shard` of `n_shards` holds: the first
    vocab_size % n_shards shards hold one row more, so any vocabulary splits."""
    if not 1 <= n_shards <= vocab_size or not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} of {n_shards} over a vocabulary of {vocab_size}: use "
                         f"0 <= shard < n_shards <= vocab_size")
    base, extra = divmod(vocab_size, n_shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (shard < extra)


def _local_targets(targets: np.ndarray, row0: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(token indices whose target is one of the shard's rows, those targets in shard rows)."""
    t = np.asarray(targets).astype(np.int64)
    mine = np.nonzero((t != IGNORE) & (t >= row0) & (t < row0 + rows))[0]
    return mine, t[mine] - row0


def shard_stats(x: np.ndarray, w: np.ndarray, targets: np.ndarray, row0: int, *,
                sub_tokens: int = 1024) -> np.ndarray:
    """x (T, D), w (Vs, D) the shard's rows [row0, row0 + Vs), targets (T,) int (global ids) ->
    stats (T, 3) fp32 (float64 if an input is): max, sum of exp(logit - max), target logit.
    Logits exist for sub_tokens tokens at a time."""
    dt = acc_dtype(x, w)
    wf = up(w, dt)
    out = np.zeros((x.shape[0], STATS), dtype=dt)
    for t0 in range(0, x.shape[0], sub_tokens):
        t1 = min(x.shape[0], t0 + sub_tokens)
        logits = up(x[t0:t1], dt) @ wf.T                          # (t, Vs)
        mx = logits.max(axis=1)
        out[t0:t1, 0] = mx
        out[t0:t1, 1] = np.exp(logits - mx[:, None]).sum(axis=1)
        mine, col = _local_targets(targets[t0:t1], row0, w.shape[0])
        out[t0 + mine, 2] = logits[mine, col]
    return out


def merge_stats(acc: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Two shards' statistics (T, 3) as one: the larger max, both sums rescaled to it and
    added (acc's first), target logits added (at most one of the two is non-zero). The merge
    is not associative in floating point: the ring merges in one fixed order."""
    m = np.maximum(acc[:, 0], other[:, 0])
    out = np.empty_like(acc)
    out[:, 0] = m
    out[:, 1] = acc[:, 1] * np.exp(acc[:, 0] - m) + other[:, 1] * np.exp(other[:, 0] - m)
    out[:, 2] = acc[:, 2] + other[:, 2]
    return out


def stats_loss(stats: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, float, int]:
    """Every shard's merged statistics (T, 3) -> (lse (T,), loss_sum over valid tokens of
    lse - target logit, n_valid)."""
    lse = stats[:, 0] + np.log(stats[:, 1])
    valid = np.asarray(targets) != IGNORE
    return lse, float(np.sum(lse[valid] - stats[valid, 2])), int(np.count_nonzero(valid))


def shard_bwd(x: np.ndarray, w: np.ndarray, targets: np.ndarray, row0: int, lse: np.ndarray, *,
              sub_tokens: int = 1024, grad_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D), w (Vs, D), targets (T,), lse (T,) the merged log-sum-exp -> (dx_part (T, D),
    dw (Vs, D)), both in the acc dtype: the shard's part of the gradient of grad_scale *
    loss_sum (the logits are formed again, sub_tokens at a time). The shards' dx_part summed
    is the whole dx."""
    dt = acc_dtype(x, w)
    wf = up(w, dt)
    dx = np.empty(x.shape, dtype=dt)
    dw = np.zeros(w.shape, dtype=dt)
    for t0 in range(0, x.shape[0], sub_tokens):
        t1 = min(x.shape[0], t0 + sub_tokens)
        xs, tgt = up(x[t0:t1], dt), np.asarray(targets[t0:t1])
        p = np.exp(xs @ wf.T - up(lse[t0:t1], dt)[:, None])     # softmax over all V, our rows
        mine, col = _local_targets(tgt, row0, w.shape[0])
        p[mine, col] -= 1.0
        p[tgt == IGNORE] = 0.0
        p *= dt.type(grad_scale)
        dx[t0:t1] = p @ wf
        dw += p.T @ xs
    return dx, dw


def sharded_head_fwd_bwd(x: np.ndarray, w: np.ndarray, targets: np.ndarray, n_shards: int, *,
                         sub_tokens: int = 1024, grad_scale: float = 1.0
                         ) -> tuple[float, int, np.ndarray, np.ndarray]:
    """head_loss_fwd_bwd computed as n_shards vocabulary shards would (statistics merged in
    shard order 0, 1, ..., partial dx summed in the same order in the acc dtype):
    (loss_sum, n_valid, dx (T, D) in x's dtype, dw (V, D) in the acc dtype)."""
    spans = [shard_rows(w.shape[0], n_shards, s) for s in range(n_shards)]
    stats = None
    for a, b in spans:
        s = shard_stats(x, w[a:b], targets, a, sub_tokens=sub_tokens)
        stats = s if stats is None else merge_stats(stats, s)
    lse, loss_sum, n_valid = stats_loss(stats, targets)
    dx, dws = None, []
    for a, b in spans:
        part, dw = shard_bwd(x, w[a:b], targets, a, lse, sub_tokens=sub_tokens,
                             grad_scale=grad_scale)
        dx = part if dx is None else dx + part
        dws.append(dw)
    return loss_sum, n_valid, dx.astype(x.dtype), np.concatenate(dws)
