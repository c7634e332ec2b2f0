"""Probe for issue 55: does cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx: every expert's
product of one kind in one call) run the routed experts' GEMMs nearer the dense rate than the
engine's per-expert cuBLASLt loop (kernels/cuda/_cublaslt.gemm_loop, which moe_experts uses)?

For each GEMM kind of one layer and chunk (the forward X_e W_e^T, the input gradient dY_e W_e and
the weight gradient dY_e^T X_e, at the model's D and F, bf16 in, bf16 out, fp32 compute), on a
fresh random routing every repetition, it times: the loop (one cublasLtMatmul per active expert),
the grouped call (one call, a group per active expert; its pointer arrays are built before the
timed region, as a device kernel could build them from device offsets), and one dense GEMM of the
same FLOPs. GPU time by CUDA events after a drain, best of --repeat, and the host's time to
enqueue. The grouped call still takes its sizes from host arrays, so it does not remove the host
wait for the routing's offsets; it shows whether one library launch is worth building on. Checks
the grouped call's outputs against the loop's (max relative difference printed).

    python -m dataflow.bench.cublas_grouped_probe olmoe-1b-7b --tokens 8192 --out probe.json

Needs CuPy and a GPU. Prints a short table last and writes one JSON record. Never trains."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.sweep import git_commit

REPO_ROOT = Path(__file__).resolve().parents[1]


def _problems(kind: str, counts, starts, d: int, f: int, ptr):
    """Row-major (m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate) of each active
    expert's GEMM of `kind`; `ptr` maps buffer name and element offset to a device address."""
    out = []
    for e, (n_e, s) in enumerate(zip(counts.tolist(), starts.tolist())):  # Python ints
        if n_e == 0:
            continue
        if kind == "fwd":        # Y_e (n_e, F) = X_e (n_e, D) @ W_e^T, W_e stored (F, D)
            out.append((n_e, f, d, ptr("x", s * d), d, False, ptr("w", e * f * d), d, True,
                        ptr("y", s * f), f, False))
        elif kind == "dgrad":    # dX_e (n_e, D) = dY_e (n_e, F) @ W_e (F, D)
            out.append((n_e, d, f, ptr("y", s * f), f, False, ptr("w", e * f * d), d, False,
                        ptr("dx", s * d), d, False))
        else:                    # dW_e (F, D) += dY_e^T (F, n_e) @ X_e (n_e, D)
            out.append((f, d, n_e, ptr("y", s * f), f, True, ptr("x", s * d), d, False,
                        ptr("dw", e * f * d), d, True))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.cublas_grouped_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="olmoe-1b-7b", help="a zoo MoE model")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the chunk (default 8192)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--out", default="", help="JSON record path")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeat < 1:
        p.error(f"--tokens {args.tokens} and --repeat {args.repeat} must be at least 1")
    from dataflow.models.hf_config import model_config  # loads numba: not on --help's path

    cfg = model_config(args.model)
    if cfg.moe is None:
        raise SystemExit(f"{args.model}: not a mixture-of-experts model (no ModelConfig.moe)")
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import dataflow.kernels.cuda as K  # needs CuPy: imported where the GPU work starts
    from cupy_backends.cuda.libs import cublas

    G = K.grouped_gemm
    BF16 = np.dtype(ml_dtypes.bfloat16)
    t, d, f = args.tokens, cfg.model_dim, cfg.moe.expert_ffn_dim
    n, k = cfg.moe.n_experts, cfg.moe.top_k
    r = t * k
    ctx = K.CudaContext()
    mm = K.cublaslt_gemm_loop(ctx, BF16, BF16)
    has_grouped = G.available(ctx)
    version = cublas.getVersion(K.cublas_handle(ctx))
    stream = cp.cuda.get_current_stream()

    def bf(*s, scale=1.0):
        out = cp.empty(s, BF16)
        K.cast(ctx, cp.random.standard_normal(s, dtype=cp.float32) * scale, out)
        return out

    bufs = {"x": bf(r, d), "y": bf(r, f), "w": bf(n, f, d, scale=d ** -0.5),
            "dx": cp.zeros((r, d), BF16), "dw": cp.zeros((n, f, d), BF16)}
    ptr = lambda name, off: bufs[name].data.ptr + 2 * off  # noqa: E731 (bf16 elements)
    rng = np.random.default_rng(0)

    def routing():
        scores = rng.standard_normal((t, n)) + 0.3 * rng.standard_normal(n)
        idx = np.argsort(-scores, axis=1)[:, :k]
        counts = np.bincount(idx.ravel(), minlength=n).astype(np.int64)
        return counts, np.concatenate([[0], np.cumsum(counts)[:-1]])

    def loop(probs):
        for m_, n_, k_, a, lda, ta, b, ldb, tb, c, ldc, acc in probs:
            mm(m_, n_, k_, a, lda, ta, b, ldb, tb, c, ldc, acc)

    def timed(fn):
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        end.record(stream)
        end.synchronize()
        return host_s * 1e3, cp.cuda.get_elapsed_time(start, end)

    rows, checks = {}, {}
    for kind in ("fwd", "dgrad", "wgrad"):
        out_name = {"fwd": "y", "dgrad": "dx", "wgrad": "dw"}[kind]
        m_d, n_d, k_d = {"fwd": (r, f, d), "dgrad": (r, d, f), "wgrad": (f, d, r)}[kind]
        flops = 2 * m_d * n_d * k_d
        dense_a, dense_b = bf(m_d, k_d), bf(k_d, n_d)
        dense_c = cp.empty((m_d, n_d), BF16)
        res = {"loop": [], "grouped": [], "dense": []}
        for rep in range(args.repeat + 1):
            counts, starts = routing()
            probs = _problems(kind, counts, starts, d, f, ptr)
            bufs[out_name][...] = 0
            res_loop = timed(lambda: loop(probs))
            if rep == 0:
                ref = bufs[out_name].astype(cp.float32)
            if has_grouped:
                call = G.prepare(probs, BF16, BF16)
                bufs[out_name][...] = 0
                res_grouped = timed(lambda: G.launch(ctx, call))
                if rep == 0:
                    got = bufs[out_name].astype(cp.float32)
                    checks[kind] = float(cp.abs(got - ref).max() / cp.abs(ref).max())
            res_dense = timed(lambda: mm(m_d, n_d, k_d, dense_a.data.ptr, k_d, False,
                                         dense_b.data.ptr, n_d, False, dense_c.data.ptr, n_d,
                                         False))
            if rep == 0:
                continue  # the first repetition warms the caches and is not timed
            res["loop"].append(res_loop)
            res["dense"].append(res_dense)
            if has_grouped:
                res["grouped"].append(res_grouped)
        rows[kind] = {name: {"host_ms": min(x[0] for x in v), "gpu_ms": min(x[1] for x in v),
                             "tflop_per_s": flops / min(x[1] for x in v) / 1e9}
                      for name, v in res.items() if v}
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    record = {"kind": "cublas_grouped_probe", "device": props["name"].decode(),
              "commit": git_commit(REPO_ROOT), "cublas_version": version,
              "shape": {"model": cfg.name, "tokens": t, "d": d, "f": f, "n_experts": n,
                        "top_k": k}, "grouped_available": has_grouped,
              "rows": rows, "max_rel_diff_vs_loop": checks}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{cfg.name}: T {t}, D {d}, F {f}, {n} experts, k {k} on {record['device']}, "
          f"cuBLAS {version}")
    print(f"  {'GEMM':6s} {'path':8s} {'host ms':>8s} {'GPU ms':>8s} {'TFLOP/s':>8s} "
          f"{'of dense':>8s}")
    for kind, by in rows.items():
        dense = by["dense"]["tflop_per_s"]
        for name, row in by.items():
            print(f"  {kind:6s} {name:8s} {row['host_ms']:8.2f} {row['gpu_ms']:8.3f} "
                  f"{row['tflop_per_s']:8.0f} {row['tflop_per_s'] / dense:8.2f}")
    print(f"  grouped vs loop, max |diff| / max |loop|: {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
