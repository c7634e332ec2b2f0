"""Token embedding on the GPU (kernels/cuda/embedding.cu): gather forward, deterministic
scatter-add backward; matches dataflow.kernels.reference.embedding. Enqueued on the current CuPy stream;
no sync, no allocation, no atomics (so repeated runs are bit-identical)."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32, I32

_SRC = "embedding.cu"
_NAMES = tuple(
    ["embedding_fwd_kernel<uint4>", "embedding_fwd_kernel<unsigned short>"]
    + [f"embedding_bwd_kernel<{t}, {w}, {m}>" for t in ("bf16", "float")
       for w in ("bf16", "float") for m in (1, 2, 4)]
)
_THREADS = 256


def embedding_fwd(ctx, ids, table, out) -> None:
    """ids (T,) int32 device, table (V, D) bf16|f32 -> out (T, D) same dtype (exact gather).

    Ids outside [0, V) produce NaN rows (a device kernel cannot raise without a sync).
    """
    t = ids.shape[0]
    v, d = table.shape
    _build.check("ids", ids, (t,), (I32,))
    _build.check("table", table, (v, d))
    _build.check("out", out, (t, d), (table.dtype,))
    row_bytes = d * table.dtype.itemsize
    if row_bytes % 16 == 0 and _build.aligned16(table, out):
        unit, units = "uint4", row_bytes // 16
    else:
        unit, units = "unsigned short", row_bytes // 2
    k = _build.kernel(ctx, _SRC, _NAMES, f"embedding_fwd_kernel<{unit}>")
    if t:
        k((_build.flat_grid(ctx, t * units, _THREADS),), (_THREADS,),
          (ids, table, out, np.int32(t), np.int64(units), np.int32(v)))


def embedding_bwd(ctx, ids, dx, dtable) -> None:
    """ids (T,) int32, dx (T, D) bf16|f32 -> dtable (V, D) bf16|f32 += rows of dx summed per id.

    Deterministic: one block owns each distinct id and sums its rows in token order in fp32,
    then adds into dtable once (one bf16 rounding per call for a bf16 dtable). Ids outside
    [0, V) are skipped. D must be a multiple of 8, at most 8192.
    """
    t = ids.shape[0]
    v, d = dtable.shape
    _build.check("ids", ids, (t,), (I32,))
    _build.check("dx", dx, (t, d))
    _build.check("dtable", dtable, (v, d), (BF16, F32))
    if d % 8 or d > 8192 or not _build.aligned16(dx, dtable):
        raise ValueError(f"embedding_bwd needs model_dim a multiple of 8 up to 8192 and 16-byte "
                         f"aligned dx, dtable; got D={d}")
    maxp = next(m for m in (1, 2, 4) if d // 8 <= m * _THREADS)
    name = (f"embedding_bwd_kernel<{_build.ctype(dx.dtype, 'dx')}, "
            f"{_build.ctype(dtable.dtype, 'dtable')}, {maxp}>")
    if t:
        _build.kernel(ctx, _SRC, _NAMES, name)((t,), (_THREADS,),
                                          (ids, dx, dtable, np.int32(t), np.int32(d), np.int32(v)))
