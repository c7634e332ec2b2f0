"""The routed experts' GEMM loop of the CuPy backend at a model's shapes (issue 41): one layer and
one chunk of kernels.cuda.moe_experts' experts_fwd + experts_bwd (the expert GEMMs, the SwiGLU and
the input gradient's casts) on random routing, timed two ways: the host's time to enqueue them
(perf_counter around the calls, nothing waited for) and the GPU's (CUDA events around the same
calls, after a full drain), and the GPU's own time (the calls enqueued behind a spinning kernel, so
they run back to back whatever the host's pace). Timed twice: with a new routing every repetition
(new row counts, as every layer and chunk of a training step has: the case that matters, where
cuBLAS's gemmEx ran its heuristics for every GEMM) and with one routing repeated (sizes seen
before; the twentieth session's bench measured only this and so missed that cost). Beside them, the
GPU time of one dense GEMM chain of the same FLOPs (what the planner's prediction assumes the loop
runs at) and cProfile's top host functions of one more repetition. GPU time no longer than the
host's (within 10 %) means the loop is launch bound there: the GPU idles between GEMMs however fast
they are.

    python -m dataflow.bench.moe_experts_bench olmoe-1b-7b --tokens 8192 --out moe.json

Needs CuPy and a GPU. Prints a short table last and writes one JSON record (device, commit,
shape, the times in ms, the top profile lines). Never trains and never plans."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from dataflow.bench.sweep.sweep import git_commit
from dataflow.memplan.plan.buffers import CUBLAS_WORKSPACE_BYTES

REPO_ROOT = Path(__file__).resolve().parents[1]


def _shape(model: str, tokens: int) -> dict:
    from dataflow.models.hf_config import model_config  # loads numba (about 2 s): not on --help's path

    cfg = model_config(model)
    if cfg.moe is None:
        raise SystemExit(f"{model}: not a mixture-of-experts model (no ModelConfig.moe)")
    return {"model": cfg.name, "tokens": tokens, "d": cfg.model_dim, "f": cfg.moe.expert_ffn_dim,
            "n_experts": cfg.moe.n_experts, "top_k": cfg.moe.top_k}


def _time_cases(cp, stream, repeat: int, cases) -> dict:
    """{name: host enqueue, GPU and queued-GPU ms} of each (name, fn) of `cases`: the best of
    `repeat` repetitions each way, on `stream`, after one untimed call."""
    import numpy as np

    # The GPU's own time: a spinning kernel holds the stream while the host enqueues the calls
    # behind it, so the events around them time the kernels back to back, not the launches.
    spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "spin")
    khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["clockRate"]
    spin_cycles = np.int64(khz * 1000 * 0.2)  # 0.2 s at the base clock: longer than any enqueue
    rows = {}
    for name, fn in cases:
        fn()
        stream.synchronize()
        host_s, gpu_s, queued_gpu_s = [], [], []
        for i in range(2 * repeat):
            behind = i % 2 == 1  # every other repetition runs queued behind the spin
            start, end = cp.cuda.Event(), cp.cuda.Event()
            stream.synchronize()
            if behind:
                spin((1,), (1,), (spin_cycles,))
            start.record(stream)
            t0 = time.perf_counter()
            fn()
            enqueue_s = time.perf_counter() - t0
            end.record(stream)
            end.synchronize()
            elapsed_s = cp.cuda.get_elapsed_time(start, end) / 1e3
            if behind:
                queued_gpu_s.append(elapsed_s)
            else:
                host_s.append(enqueue_s)
                gpu_s.append(elapsed_s)
        rows[name] = {"host_enqueue_ms": 1e3 * min(host_s), "gpu_ms": 1e3 * min(gpu_s),
                      "gpu_queued_ms": 1e3 * min(queued_gpu_s)}
    return rows


def _print_table(record: dict, shape: dict) -> None:
    """The profile's top lines, then the short table of main's record."""
    t, d, f, n, k = (shape[x] for x in ("tokens", "d", "f", "n_experts", "top_k"))
    r = t * k
    rows = record["rows"]
    print("\n".join(record["profile_top"]))
    print(f"{shape['model']}: T {t}, D {d}, F {f}, {n} experts, k {k} ({r} routed rows) on "
          f"{record['device']}")
    print(f"  {'':26s} {'host enqueue ms':>16s} {'GPU ms':>9s} {'GPU ms, queued':>15s}")
    for name, row in rows.items():
        print(f"  {name:26s} {row['host_enqueue_ms']:16.2f} {row['gpu_ms']:9.2f} "
              f"{row['gpu_queued_ms']:15.2f}")
    print(f"  loop at {record['loop_tflop_per_s']:.0f} TFLOP/s of GPU time; launch bound: "
          f"{record['launch_bound']}; dense at {record['dense_tflop_per_s']:.0f}")
    if record.get("grouped_tflop_per_s"):
        print(f"  grouped at {record['grouped_tflop_per_s']:.0f} TFLOP/s "
              f"({record['grouped_tflop_per_s'] / record['dense_tflop_per_s']:.2f} of dense)")


def _weights(ctx, cp, K, bf, shape, as_engine: bool):
    """The experts' weights and their gradients: views of one layer block, an expert's three
    matrices together, with bf16 gradients and the engine's cuBLAS workspace (models/layout), or
    separate stacked arrays with fp32 gradients; last, the workspace (None without one)."""
    import ml_dtypes
    import numpy as np

    n, f, d = shape
    BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
    if as_engine:
        block = bf(n, 3 * f * d, scale=d ** -0.5)
        gblock = cp.zeros((n, 3 * f * d), BF16)
        ws = [block[:, i * f * d:(i + 1) * f * d].reshape(n, *s_)
              for i, s_ in enumerate(((f, d), (f, d), (d, f)))]
        gs = [gblock[:, i * f * d:(i + 1) * f * d].reshape(n, *s_)
              for i, s_ in enumerate(((f, d), (f, d), (d, f)))]
        workspace = cp.empty(CUBLAS_WORKSPACE_BYTES, cp.uint8)
        K.set_cublas_workspace(ctx, workspace)
        return (*ws, *gs, workspace)
    return (bf(n, f, d, scale=d ** -0.5), bf(n, f, d, scale=d ** -0.5),
            bf(n, d, f, scale=f ** -0.5), cp.zeros((n, f, d), F32), cp.zeros((n, f, d), F32),
            cp.zeros((n, d, f), F32), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.moe_experts_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="olmoe-1b-7b", help="a zoo MoE model")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the chunk (default 8192)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--as-engine", action="store_true",
                   help="lay the weights and bf16 gradients out as the engine's layer block does "
                        "(each expert's gate, up and down together) and give cuBLAS the engine's "
                        "workspace (default: separate stacked arrays, fp32 gradients, none)")
    p.add_argument("--grouped", action="store_true",
                   help="also time the grouped kernels (kernels/cuda/moe_grouped.py: one launch "
                        "per GEMM kind, offsets on the device); needs D and F multiples of 256")
    p.add_argument("--out", default="", help="JSON record path")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeat < 1:
        p.error(f"--tokens {args.tokens} and --repeat {args.repeat} must be at least 1")
    shape = _shape(args.model, args.tokens)
    import cupy as cp
    import numpy as np

    import dataflow.kernels.cuda as K  # needs CuPy: imported where the GPU work starts
    from dataflow.kernels.cuda import moe_grouped as KG  # likewise
    import ml_dtypes

    BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)

    ctx = K.CudaContext()  # the kernels' handles and caches for this benchmark
    t, d, f, n, k = (shape[x] for x in ("tokens", "d", "f", "n_experts", "top_k"))
    r = t * k
    rng = np.random.default_rng(0)
    order, offsets = cp.empty(r, np.int64), cp.empty(n + 1, np.int64)

    def routing():
        """Host offsets of a fresh routing: k distinct experts a token, expert popularity
        varying from draw to draw as a router's does."""
        scores = rng.standard_normal((t, n)) + 0.3 * rng.standard_normal(n)
        idx = np.argsort(-scores, axis=1)[:, :k].astype(np.int64)
        K.expert_order(ctx, cp.asarray(idx), n, order, offsets)
        return offsets.get()

    host_off = routing()
    dev_off = offsets.copy()
    fresh = [routing() for _ in range(2 * args.repeat + 1)]  # one per call below
    fresh_dev = [cp.asarray(o) for o in fresh]  # the same routings on the device (grouped)

    def bf(*s, scale=1.0):
        out = cp.empty(s, BF16)
        K.cast(ctx, cp.random.standard_normal(s, dtype=cp.float32) * scale, out)
        return out

    xp, dyp = bf(r, d), bf(r, d)
    # the workspace (engine layout only) is kept alive for as long as cuBLAS points at it
    wg, wu, wd, dwg, dwu, dwd, _workspace = _weights(ctx, cp, K, bf, (n, f, d), args.as_engine)
    yp, dxp = cp.empty((r, d), BF16), cp.empty((r, d), BF16)
    gate, up, h, dgate, dup, act = (cp.empty((r, f), BF16) for _ in range(6))
    acc = cp.empty(t * d, F32)  # the engine lends (T, D) fp32

    def layer(off=None):
        off = host_off if off is None else off
        K.experts_fwd(ctx, xp, off, wg, wu, wd, yp, gate, up, h=act)
        K.experts_bwd(ctx, xp, off, wg, wu, wd, gate, up, dyp, dxp, dwg, dwu, dwd, dgate=dgate,
                      dup=dup, h=h, dx_acc=acc)

    new_routing = iter(fresh)
    new_routing_dev = iter(fresh_dev)

    def grouped(off=None):  # the grouped kernels: offsets stay on the device
        off = dev_off if off is None else off
        KG.grouped_experts_fwd(ctx, xp, off, wg, wu, wd, yp, gate, up, h=act)
        KG.grouped_experts_bwd(ctx, xp, off, wg, wu, wd, gate, up, dyp, dxp, dwg, dwu, dwd,
                               dgate=dgate, dup=dup, h=h)

    a, b, c = bf(r, d), bf(f, d), cp.empty((r, f), BF16)

    def dense():  # the loop's FLOPs as 9 GEMMs of (R, D) x (D, F): fwd 3, bwd 6
        for _ in range(9):
            K.linear_fwd(ctx, a, b, c)

    stream = cp.cuda.get_current_stream()
    cases = (("experts loop, new routing", lambda: layer(next(new_routing))),
             ("experts loop, same routing", layer),
             ("dense GEMMs, same FLOPs", dense))
    if args.grouped:
        cases += (("experts grouped, new routing", lambda: grouped(next(new_routing_dev))),
                  ("experts grouped, same routing", grouped))
    rows = _time_cases(cp, stream, args.repeat, cases)
    prof = cProfile.Profile()
    prof.enable()
    layer()
    prof.disable()
    stream.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    flops = 2 * 9 * r * d * f
    loop = rows["experts loop, new routing"]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    record = {"kind": "moe_experts_bench", "device": props["name"].decode(),
              "commit": git_commit(REPO_ROOT), "shape": shape, "as_engine": args.as_engine,
              "active_experts": int(np.count_nonzero(np.diff(host_off))), "rows": rows,
              "loop_tflop_per_s": flops / loop["gpu_ms"] / 1e9,
              "dense_tflop_per_s": flops / rows["dense GEMMs, same FLOPs"]["gpu_ms"] / 1e9,
              "grouped_tflop_per_s": (flops / rows["experts grouped, new routing"]["gpu_ms"]
                                      / 1e9 if args.grouped else None),
              # a loop the host feeds slower than the GPU runs it ends on the GPU when the host
              # ends: GPU time about the host's (call E: 8.49 and 8.50 ms)
              "launch_bound": loop["host_enqueue_ms"] >= 0.9 * loop["gpu_ms"],
              "profile_top": [ln for ln in text.getvalue().splitlines() if ln.strip()][:24]}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    _print_table(record, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
