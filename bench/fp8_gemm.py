"""FP8 against bf16 for the linear layers of a Llama3-8B block on the current GPU (issue 53): each
projection's three GEMMs (y = x w^T, dx = dy w, dw = dy^T x) in bf16 (kernels.cuda.linear, cuBLAS)
and in FP8 (kernels.cuda.fp8_gemm, cuBLASLt; E4M3 x and w, E5M2 dy), and the quantise passes the
FP8 path adds (amax + cast + transpose of x, w and dy: kernels.cuda.fp8). Prints a table and
writes a JSON record (device, commit, config, per-GEMM milliseconds and TFLOP/s, the speedup of
the GEMMs alone and with the quantise passes counted). Random inputs, never zeros; CUDA events,
median of repeats after warm-up. Needs CuPy and an sm_89+ GPU.

    python -m dataflow.bench.fp8_gemm [--tokens 8192] [--out FILE] [--repeats 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys

import ml_dtypes
import numpy as np

from dataflow.bench.kernels_bench import _commit, _time_ms

PROJECTIONS = (("q", 4096, 4096), ("kv", 1024, 4096), ("o", 4096, 4096),
               ("gate_up", 2 * 14336, 4096), ("down", 4096, 14336))
"""(name, out_features, in_features) of Llama3-8B's block projections (k and v as one of the
two, gate and up fused as the engine runs them)."""


def _bench_projection(cp, kc, ctx, t: int, o: int, i: int, warmup: int, repeats: int) -> dict:
    BF16 = np.dtype(ml_dtypes.bfloat16)
    rng = cp.random.default_rng(1234 + o + i)

    def randn(shape, scale):
        f = rng.standard_normal(shape, dtype=cp.float32) * scale
        out = cp.empty(shape, BF16)
        kc.cast(ctx, f, out)
        return out

    x, w, dy = randn((t, i), 1.0), randn((o, i), 0.02), randn((t, o), 1e-3)
    y, dx = cp.empty((t, o), BF16), cp.empty((t, i), BF16)
    dw = cp.zeros((o, i), cp.float32)
    u8 = np.uint8
    x8, xt8, w8, wt8 = (cp.empty(s, u8) for s in ((t, i), (i, t), (o, i), (i, o)))
    d8, dt8 = cp.empty((t, o), u8), cp.empty((o, t), u8)
    sx, sw, sd = (cp.ones(3, cp.float32) for _ in range(3))
    ops = {
        "bf16 fwd": lambda: kc.linear_fwd(ctx, x, w, y),
        "bf16 dx": lambda: kc.linear_bwd_x(ctx, dy, w, dx),
        "bf16 dw": lambda: kc.linear_bwd_w(ctx, dy, x, dw),
        "quant x": lambda: kc.fp8_quantise(ctx, x, "e4m3", sx, x8, xt8),
        "quant w": lambda: kc.fp8_quantise(ctx, w, "e4m3", sw, w8, wt8),
        "quant dy": lambda: kc.fp8_quantise(ctx, dy, "e5m2", sd, d8, dt8),
        "fp8 fwd": lambda: kc.fp8_gemm(ctx, x8, "e4m3", sx, w8, "e4m3", sw, y),
        "fp8 fwd fast": lambda: kc.fp8_gemm(ctx, x8, "e4m3", sx, w8, "e4m3", sw, y,
                                            fast_accum=True),
        "fp8 dx": lambda: kc.fp8_gemm(ctx, d8, "e5m2", sd, wt8, "e4m3", sw, dx),
        "fp8 dw": lambda: kc.fp8_gemm(ctx, dt8, "e5m2", sd, xt8, "e4m3", sx, dw,
                                      accumulate=True),
    }
    ms = {}
    for name, fn in ops.items():
        dev_ms, _ = _time_ms(cp, fn, warmup, repeats)
        ms[name] = statistics.median(dev_ms)
    flops = 2.0 * t * o * i
    tflops = {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items() if "quant" not in k}
    bf = ms["bf16 fwd"] + ms["bf16 dx"] + ms["bf16 dw"]
    f8 = ms["fp8 fwd"] + ms["fp8 dx"] + ms["fp8 dw"]
    quant = ms["quant x"] + ms["quant dy"]  # w is quantised once per update, not per chunk
    return dict(out_features=o, in_features=i, ms=ms, tflops=tflops,
                speedup_gemms=bf / f8, speedup_with_quant=bf / (f8 + quant),
                quant_w_ms=ms["quant w"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one chunk (default 8192)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON record path (default: print only)")
    args = p.parse_args(argv)
    import cupy as cp

    # Imported here: the module's --help must work without CuPy.
    import dataflow.kernels.cuda as kc

    ctx = kc.CudaContext()
    ws = cp.empty(64 << 20, np.uint8)
    kc.set_cublas_workspace(ctx, ws)
    rows = {}
    for name, o, i in PROJECTIONS:
        rows[name] = _bench_projection(cp, kc, ctx, args.tokens, o, i, args.warmup, args.repeats)
    bf = sum(r["ms"]["bf16 fwd"] + r["ms"]["bf16 dx"] + r["ms"]["bf16 dw"] for r in rows.values())
    f8 = sum(r["ms"]["fp8 fwd"] + r["ms"]["fp8 dx"] + r["ms"]["fp8 dw"] for r in rows.values())
    qt = sum(r["ms"]["quant x"] + r["ms"]["quant dy"] for r in rows.values())
    print(f"{'proj':8} {'O x I':>12} | {'bf16 fwd/dx/dw TFLOP/s':>24} | "
          f"{'fp8 fwd/dx/dw TFLOP/s':>23} | {'quant x+dy ms':>13} | gemms  +quant")
    for name, r in rows.items():
        t = r["tflops"]
        print(f"{name:8} {r['out_features']:>5}x{r['in_features']:<6} | "
              f"{t['bf16 fwd']:6.0f} {t['bf16 dx']:6.0f} {t['bf16 dw']:6.0f}     | "
              f"{t['fp8 fwd']:6.0f} {t['fp8 dx']:6.0f} {t['fp8 dw']:6.0f}    | "
              f"{r['ms']['quant x'] + r['ms']['quant dy']:13.3f} | "
              f"{r['speedup_gemms']:5.2f}x {r['speedup_with_quant']:5.2f}x")
    print(f"block total: bf16 {bf:.2f} ms, fp8 {f8:.2f} ms + quantise {qt:.2f} ms: "
          f"{bf / f8:.2f}x GEMMs alone, {bf / (f8 + qt):.2f}x with quantise")
    record = dict(bench="fp8_gemm", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                  commit=_commit(), host=platform.node(), tokens=args.tokens,
                  repeats=args.repeats, projections=rows,
                  block=dict(bf16_ms=bf, fp8_ms=f8, quant_ms=qt, speedup_gemms=bf / f8,
                             speedup_with_quant=bf / (f8 + qt)))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
