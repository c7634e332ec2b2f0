"""Split-sequence attention at several query-chunk sizes: forward and backward of one chunk at a
few positions of a long sequence (dataflow.ops_cuda.CudaOps, as the engine runs them: the
planner's key block for the backward), hardware TFLOP/s per position and a whole-sequence
estimate per chunk size (time per chunk interpolated over the positions timed). Answers
whether a longer query chunk makes long-context attention faster. Prints a table and writes a
JSON record. GPU only.

    python bench/archive/attention_chunks.py --model 1b --seqlen 1048576 --chunks 16384,32768,65536 \
        --out bench/records/attention-chunks-1b-h100.json"""

from __future__ import annotations

import argparse

# bench/archive/ is not a package (nothing installs or imports it): run as a script, this
# folder is sys.path[0], so its sibling imports by its file name.
from attention_blocks import bf16_normal, chunk_positions, gpu_record, seconds_per_call, write_record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--seqlen", type=int, default=1048576)
    ap.add_argument("--chunks", default="16384,32768,65536", help="query-chunk sizes, tokens")
    ap.add_argument("--positions", type=int, default=3, help="chunk positions timed per size")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import cupy as cp
    import numpy as np

    from dataflow.ops_cuda import CudaOps
    from dataflow.memplan.plan.buffers import attention_key_block
    from dataflow.models.config import load_config

    cfg = load_config(a.model)
    s, h, kh, e = a.seqlen, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rnd = cp.random.default_rng(0)
    k, v = bf16_normal(rnd, (s, kh, e)), bf16_normal(rnd, (s, kh, e))
    bf16 = k.dtype
    dk, dv = cp.zeros((s, kh, e), cp.float32), cp.zeros((s, kh, e), cp.float32)

    def timed(call) -> float:
        return seconds_per_call(call, a.reps)

    rows = []
    for t in [int(c) for c in a.chunks.split(",")]:
        n_chunks = s // t
        block = attention_key_block(cfg, t, s)
        q, o, do = (bf16_normal(rnd, (t, h, e)) for _ in range(3))
        lse = rnd.standard_normal((h, t), dtype=cp.float32) + 5.0
        dq = cp.empty((t, h, e), bf16)
        ops = CudaOps()
        ws = 16 * block * kh * e + 4 * t * h * e + (4 << 20)
        ops.lend_scratch({"attn_workspace": cp.empty(ws, cp.uint8),
                          "dk16": cp.empty((block, kh, e), bf16),
                          "dv16": cp.empty((block, kh, e), bf16),
                          "dq32": cp.empty((t, h, e), cp.float32)})
        positions = chunk_positions(n_chunks, a.positions)
        fwd, bwd = {}, {}
        for c in positions:
            off = c * t
            fwd[c] = timed(lambda: ops.attention_fwd(q, k[:off + t], v[:off + t], off, o, lse))
            bwd[c] = timed(lambda: ops.attention_bwd(q, k[:off + t], v[:off + t], o, lse, do,
                                                     off, dq, dk[:off + t], dv[:off + t]))

        def pairs(c):  # causal query/key pairs of chunk c, as dataflow.models.flops counts them
            return t * (c * t + t / 2)

        fl = {c: 4 * pairs(c) * h * e for c in positions}  # forward matmuls; backward 2.5x
        est = {name: float(np.interp(np.arange(n_chunks), positions,
                                     [per[c] for c in positions]).sum())
               for name, per in (("fwd", fwd), ("bwd", bwd))}
        total = sum(4 * pairs(c) * h * e for c in range(n_chunks))
        rows.append({"chunk": t, "key_block": block, "positions": positions,
                     "fwd_s": {str(c): fwd[c] for c in positions},
                     "bwd_s": {str(c): bwd[c] for c in positions},
                     "fwd_tflops": {str(c): fl[c] / fwd[c] / 1e12 for c in positions},
                     "bwd_tflops": {str(c): 2.5 * fl[c] / bwd[c] / 1e12 for c in positions},
                     "sequence_fwd_s_est": est["fwd"], "sequence_bwd_s_est": est["bwd"],
                     "sequence_fwd_tflops": total / est["fwd"] / 1e12,
                     "sequence_bwd_tflops": 2.5 * total / est["bwd"] / 1e12})
    rec = gpu_record("attention_chunks", {"model": a.model, "seqlen": s, "reps": a.reps}, rows)
    print(f"{a.model} at {s:,} tokens: one sequence's attention, estimated from the positions "
          "timed")
    print(f"{'chunk':>7} {'key block':>9} {'fwd s':>8} {'TFLOP/s':>8} {'bwd s':>8} {'TFLOP/s':>8}"
          "  bwd TFLOP/s per position")
    for r in rows:
        per = " ".join(f"{c}:{x:.0f}" for c, x in r["bwd_tflops"].items())
        print(f"{r['chunk']:>7} {r['key_block']:>9} {r['sequence_fwd_s_est']:>8.2f} "
              f"{r['sequence_fwd_tflops']:>8.0f} {r['sequence_bwd_s_est']:>8.2f} "
              f"{r['sequence_bwd_tflops']:>8.0f}  {per}")
    write_record(rec, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
