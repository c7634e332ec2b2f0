"""The vocabulary-parallel head on the GPU (kernels/cuda/head_vocab.cu + cuBLAS): a ring rank's
shard of the lm_head rows forms its per-token statistics, merges another shard's into its own,
turns merged statistics into the loss, and forms its partial dx and its rows' weight gradient;
matches dataflow.kernels.reference.head_vocab (shard_stats, merge_stats, stats_loss, shard_bwd)
up to fp32 sums' order, with the dlogits rounded to bf16 before the gradient GEMMs as
head_loss_fwd_bwd rounds them. Logits exist for logits.shape[0] tokens at a time, in the fp32
scratch the caller lends (its contents are destroyed). Enqueued on the current CuPy stream; no
sync, no allocation."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32, I32
from dataflow.kernels.cuda._cublas import gemm

_SRC = "head_vocab.cu"
_NAMES = ("vocab_stats_kernel<4>", "vocab_stats_kernel<1>", "vocab_merge_kernel",
          "vocab_loss_kernel", "vocab_dlogits_kernel<4>", "vocab_dlogits_kernel<1>")
STATS = 3
"""Columns of the per-token statistics: max logit, sum of exp(logit - max), target logit."""


def _check_shard(x, w, targets, logits) -> tuple[int, int, int, int]:
    """(T, D, Vs, sub) of a shard's arguments, each checked."""
    t, d = x.shape
    v = w.shape[0]
    _build.check("x", x, (t, d), (BF16,))
    _build.check("w", w, (v, d), (BF16,))
    _build.check("targets", targets, (t,), (I32,))
    if logits.ndim != 2 or logits.shape[1] != v or logits.shape[0] < 1:
        raise ValueError(f"logits scratch must be (sub, Vs={v}) fp32; got {tuple(logits.shape)}")
    _build.check("logits", logits, tuple(logits.shape), (F32,))
    return t, d, v, logits.shape[0]


def _vec(v: int, logits) -> int:
    return 4 if v % 4 == 0 and logits.data.ptr % 16 == 0 else 1


def _logits(ctx, x, w, logits, t0: int, rows: int) -> int:
    """logits[:rows] = x[t0:t0 + rows] @ w.T (fp32, gemmEx); the pointer of x's rows."""
    d, v = x.shape[1], w.shape[0]
    xs = x.data.ptr + t0 * d * x.dtype.itemsize
    gemm(ctx, rows, v, d, xs, x.dtype, d, False, w.data.ptr, w.dtype, d, True,
         logits.data.ptr, F32, v, False)
    return xs


def vocab_stats(ctx, x, w, targets, row0: int, logits, stats) -> None:
    """x (T, D) bf16, w (Vs, D) bf16 the shard's rows from global row row0, targets (T,) int32
    (global ids, IGNORE = -100) -> stats (T, 3) fp32 written: max, sum of exp(logit - max),
    the target's logit (0 where the target is not one of the shard's rows or is ignored)."""
    t, _, v, sub = _check_shard(x, w, targets, logits)
    _build.check("stats", stats, (t, STATS), (F32,))
    kernel = _build.kernel(ctx, _SRC, _NAMES, f"vocab_stats_kernel<{_vec(v, logits)}>")
    for t0 in range(0, t, sub):
        rows = min(sub, t - t0)
        _logits(ctx, x, w, logits, t0, rows)
        kernel((rows,), (1024,), (logits, np.int32(v), targets[t0:t0 + rows], np.int32(row0),
                                  stats[t0:t0 + rows]))


def vocab_merge(ctx, stats, other) -> None:
    """stats (T, 3) fp32 = the merge of stats and other (T, 3) fp32 (stats first)."""
    _build.check("stats", stats, None, (F32,))
    if stats.ndim != 2 or stats.shape[1] != STATS:
        raise ValueError(f"stats must be (T, {STATS}) fp32; got {tuple(stats.shape)}")
    _build.check("other", other, tuple(stats.shape), (F32,))
    t = stats.shape[0]
    if t:
        _build.kernel(ctx, _SRC, _NAMES, "vocab_merge_kernel")(
            (-(-t // 256),), (256,), (stats, other, np.int64(t)))


def vocab_loss(ctx, stats, targets, loss_acc) -> None:
    """loss_acc (2,) fp32 += [sum over the tokens not ignored of max + log(sum) - target
    logit, their count] of the merged statistics stats (T, 3) fp32, targets (T,) int32."""
    t = stats.shape[0] if stats.ndim == 2 else -1
    _build.check("stats", stats, (t, STATS), (F32,))
    _build.check("targets", targets, (t,), (I32,))
    _build.check("loss_acc", loss_acc, (2,), (F32,))
    _build.kernel(ctx, _SRC, _NAMES, "vocab_loss_kernel")(
        (1,), (1024,), (stats, targets, np.int32(t), loss_acc))


def vocab_grad(ctx, x, w, targets, row0: int, stats, logits, grad_scale: float, dx,
               dw) -> None:
    """The shard's part of the gradient of grad_scale * loss_sum from the merged statistics
    stats (T, 3) fp32: dx (T, D) fp32 written (the shards' parts summed are the whole dx), dw
    (Vs, D) bf16|f32 += (None: a frozen head). The logits are formed again, a sub-chunk at a
    time, rewritten in place as bf16 dlogits (row stride 2 Vs), then dx_s = dlogits @ w and
    dw += dlogits.T @ x_s (gemmEx, fp32 accumulation)."""
    t, d, v, sub = _check_shard(x, w, targets, logits)
    _build.check("stats", stats, (t, STATS), (F32,))
    _build.check("dx", dx, (t, d), (F32,))
    if dw is not None:
        _build.check("dw", dw, (v, d))
    kernel = _build.kernel(ctx, _SRC, _NAMES, f"vocab_dlogits_kernel<{_vec(v, logits)}>")
    lp = logits.data.ptr
    for t0 in range(0, t, sub):
        rows = min(sub, t - t0)
        xs = _logits(ctx, x, w, logits, t0, rows)
        kernel((rows,), (1024,), (logits, np.int32(v), targets[t0:t0 + rows], np.int32(row0),
                                  stats[t0:t0 + rows], np.float32(grad_scale)))
        gemm(ctx, rows, d, v, lp, BF16, 2 * v, False, w.data.ptr, w.dtype, d, False,
             dx.data.ptr + t0 * d * 4, F32, d, False)
        if dw is not None:
            gemm(ctx, v, d, rows, lp, BF16, 2 * v, True, xs, x.dtype, d, False,
                 dw.data.ptr, dw.dtype, d, True)
