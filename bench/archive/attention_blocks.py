"""Split-sequence attention backward, one call per chunk against its whole context versus one
call per key block (dataflow.ops_cuda.CudaOps, as the engine runs it): time per chunk at a few
positions of a long sequence, hardware TFLOP/s, workspace and scratch bytes. Prints a table and
writes a JSON record. GPU only.

    python bench/archive/attention_blocks.py --model 8b --seqlen 131072 --chunk 16384 \
        --blocks 0,65536,32768 --out bench/records/attention-blocks-h100.json
(block 0 = the whole context in one call)."""

from __future__ import annotations

import argparse
import json
import subprocess
import time


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def chunk_positions(n_chunks: int, count: int) -> list[int]:
    """`count` chunk indices spread evenly from the first chunk to the last."""
    return sorted({round(i * (n_chunks - 1) / max(1, count - 1)) for i in range(count)})


def seconds_per_call(call, reps: int) -> float:
    """GPU seconds of one `call()` (after one untimed call), averaged over `reps` by CUDA
    events."""
    import cupy as cp

    call()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def bf16_normal(rng, shape):
    """Standard normal bf16 values on the device (fresh random inputs, never zeros)."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    return rng.standard_normal(shape, dtype=cp.float32).astype(np.dtype(ml_dtypes.bfloat16))


def gpu_record(bench: str, config: dict, rows: list) -> dict:
    """A bench's JSON record: its name, the device's name, the commit, the time, config and
    rows."""
    import cupy as cp

    dev = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return {"bench": bench, "device": dev.decode() if isinstance(dev, bytes) else dev,
            "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": config, "rows": rows}


def write_record(rec: dict, path: str | None) -> None:
    """`rec` as indented JSON at `path` (nothing when no path was asked for)."""
    if path:
        with open(path, "w") as fh:
            json.dump(rec, fh, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--blocks", default="0,65536")
    ap.add_argument("--positions", type=int, default=4, help="chunk positions timed")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    from dataflow.ops_cuda import CudaOps
    from dataflow.models.config import load_config

    cfg = load_config(a.model)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    s, t, h, kh, e = a.seqlen, a.chunk, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n_chunks = s // t
    rnd = cp.random.default_rng(0)

    def randn(shape):
        return bf16_normal(rnd, shape)

    k, v = randn((s, kh, e)), randn((s, kh, e))
    q, o, do = randn((t, h, e)), randn((t, h, e)), randn((t, h, e))
    lse = rnd.standard_normal((h, t), dtype=cp.float32) + 5.0
    dq = cp.empty((t, h, e), bf16)
    dk, dv = cp.zeros((s, kh, e), cp.float32), cp.zeros((s, kh, e), cp.float32)
    positions = chunk_positions(n_chunks, a.positions)
    rows = []
    for block in [int(b) for b in a.blocks.split(",")]:
        ops = CudaOps()
        span = s if block == 0 else block
        ws = 16 * span * kh * e + 4 * t * h * e + (4 << 20)
        lent = {"attn_workspace": cp.empty(ws, cp.uint8)}
        if block:
            lent.update(dk16=cp.empty((block, kh, e), bf16), dv16=cp.empty((block, kh, e), bf16),
                        dq32=cp.empty((t, h, e), cp.float32))
        ops.lend_scratch(lent)
        scratch = sum(x.nbytes for x in lent.values())
        per = {}
        for c in positions:
            off = c * t
            per[c] = seconds_per_call(
                lambda: ops.attention_bwd(q, k[:off + t], v[:off + t], o, lse, do, off, dq,
                                          dk[:off + t], dv[:off + t]), a.reps)
        # hardware FLOPs of a causal chunk backward: 2.5 x the forward's 4*T*keys*H*E matmuls
        flops = {c: 2.5 * 4 * t * (c * t + t / 2) * h * e for c in positions}
        # whole-sequence estimate: interpolate time per key linearly over the positions timed
        est = float(np.interp(np.arange(n_chunks), positions, [per[c] for c in positions]).sum())
        total_flops = sum(2.5 * 4 * t * (c * t + t / 2) * h * e for c in range(n_chunks))
        rows.append({"block": block, "scratch_bytes": scratch + ops.library_workspace_bytes(),
                     "seconds_per_chunk": {str(c): per[c] for c in positions},
                     "tflops_per_chunk": {str(c): flops[c] / per[c] / 1e12 for c in positions},
                     "sequence_bwd_seconds_est": est,
                     "sequence_tflops_est": total_flops / est / 1e12})
        ops = lent = None  # free the scratch before the next block's
        cp.get_default_memory_pool().free_all_blocks()
    rec = gpu_record("attention_blocks", {"model": a.model, "seqlen": s, "chunk": t,
                                          "positions": positions}, rows)
    print(f"{'block':>8} {'scratch GiB':>11} {'seq bwd s':>10} {'TFLOP/s':>8}  per position "
          "(TFLOP/s)")
    for r in rows:
        per = " ".join(f"{c}:{x:.0f}" for c, x in r["tflops_per_chunk"].items())
        print(f"{r['block'] or 'whole':>8} {r['scratch_bytes'] / 2**30:>11.2f} "
              f"{r['sequence_bwd_seconds_est']:>10.2f} {r['sequence_tflops_est']:>8.0f}  {per}")
    write_record(rec, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
