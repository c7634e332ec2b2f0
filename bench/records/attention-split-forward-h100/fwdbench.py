# attention_merge no longer exists in dataflow.kernels.cuda.attention: this script fails at its merge loop (kept as it ran).
import time, sys
import cupy as cp, numpy as np, ml_dtypes
from dataflow.ops_cuda import CudaOps
from dataflow.kernels.cuda import attention as A
bf16 = np.dtype(ml_dtypes.bfloat16)
t, h, kh, e, s = 8192, 32, 8, 128, 131072
rnd = cp.random.default_rng(0)
r = lambda shp: rnd.standard_normal(shp, dtype=cp.float32).astype(bf16)
q, k, v = r((t, h, e)), r((s, kh, e)), r((s, kh, e))
o, lse = cp.empty((t, h, e), bf16), cp.empty((h, t), cp.float32)
one = CudaOps(); split = CudaOps()
split.lend_scratch({"o_part": cp.empty((t, h, e), bf16), "lse_part": cp.empty((h, t), cp.float32)})
for c in (1, 4, 8, 15):
    off = c * t
    row = []
    for name, ops in (("one", one), ("split", split)):
        ops.attention_fwd(q, k[:off + t], v[:off + t], off, o, lse); cp.cuda.Device().synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
        for _ in range(5): ops.attention_fwd(q, k[:off + t], v[:off + t], off, o, lse)
        b.record(); b.synchronize(); row.append(cp.cuda.get_elapsed_time(a, b) / 5)
    op = cp.empty_like(o); lp = cp.empty_like(lse)
    a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
    for _ in range(5): A.attention_merge(o, lse, op, lp)
    b.record(); b.synchronize(); mg = cp.cuda.get_elapsed_time(a, b) / 5
    fl = 4 * h * e * (t * off + t * (t + 1) / 2)
    print(f"chunk {c:2d}: one {row[0]:.3f} ms ({fl/row[0]/1e9:.0f} TF/s)  split {row[1]:.3f} ms ({fl/row[1]/1e9:.0f})  merge {mg:.3f} ms", flush=True)
