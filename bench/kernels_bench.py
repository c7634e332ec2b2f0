"""Times every dataflow.kernels.cuda op at Llama3-8B shapes on the current GPU and writes a JSON record.

Each op runs on fresh random data (never zeros), with warm-up, then each repeat between two
CUDA events on the current stream; the median is reported beside the op's minimum bytes moved
(every input read once, every output written once) or FLOPs, as achieved GB/s or TFLOP/s and as
a fraction of the ceilings (3.0 TB/s HBM, 780 TFLOP/s bf16 dense, both measured on the lent
H100, DESIGN.md §6). Needs CuPy and a GPU; nvidia-cudnn-frontend for attention.

    python -m dataflow.bench.kernels_bench [--out FILE] [--repeats N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from dataflow.settings import settings_from_env

HBM_BYTES_PER_S = 3.0e12
BF16_FLOP_PER_S = 780e12
CONFIG = dict(n_tokens=8192, model_dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
              ffn_dim=14336, vocab_size=128256, head_sub_tokens=1024, rope_theta=500000.0)


def _commit() -> str | None:
    if settings_from_env().commit:
        return settings_from_env().commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _time_ms(cupy, fn, warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Per-repeat device milliseconds of fn() on the current stream (events, one sync at end),
    and the host milliseconds each call took to enqueue its work (launch overhead)."""
    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    host = []
    for start, end in events:
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(s, e) for s, e in events], host


class _Arrays:
    """Random device arrays (standard normal * scale) in bf16 or fp32, made once per name."""

    def __init__(self, cupy, kc, seed: int):
        self.cupy, self.kc = cupy, kc
        self.ctx = kc.CudaContext()  # the kernels' handles and caches for this benchmark
        self.rng = cupy.random.default_rng(seed)
        self.cache = {}

    def randn(self, name, shape, dtype, scale=1.0):
        key = (name, tuple(shape), str(dtype))
        if key not in self.cache:
            f = self.rng.standard_normal(shape, dtype=self.cupy.float32) * scale
            if np.dtype(dtype) == np.float32:
                a = f
            else:
                a = self.cupy.empty(shape, dtype=dtype)
                self.kc.cast(self.ctx, f, a)
                del f
            self.cache[key] = a
        return self.cache[key]

    def ints(self, name, shape, high):
        key = (name, tuple(shape), high)
        if key not in self.cache:
            self.cache[key] = self.rng.integers(0, high, size=shape, dtype=self.cupy.int32)
        return self.cache[key]

    def free(self):
        self.cache.clear()
        self.cupy.get_default_memory_pool().free_all_blocks()


def _cases(cupy, kc, a: _Arrays, c: dict):
    """(name, fn, bytes, flop, repeats scale) for each op at the config's shapes."""
    import ml_dtypes
    ctx = a.ctx
    bf16, f32 = ml_dtypes.bfloat16, cupy.float32
    t, d, h, kh, e = c["n_tokens"], c["model_dim"], c["n_heads"], c["n_kv_heads"], c["head_dim"]
    f, v = c["ffn_dim"], c["vocab_size"]
    x, dy = a.randn("x", (t, d), bf16), a.randn("dy", (t, d), bf16)
    w_norm = a.randn("w_norm", (d,), bf16, 0.1)
    y, dx = cupy.empty((t, d), bf16), cupy.empty((t, d), bf16)
    rstd = cupy.empty(t, f32)
    dw_norm = cupy.zeros(d, f32)
    kc.rms_norm_fwd(ctx, x, w_norm, 1e-5, y, rstd)
    yield ("rms_norm_fwd", lambda: kc.rms_norm_fwd(ctx, x, w_norm, 1e-5, y, rstd),
           4 * t * d + 4 * t, 0)
    yield ("rms_norm_bwd (dw f32 +=)",
           lambda: kc.rms_norm_bwd(ctx, x, w_norm, rstd, dy, dx, dw_norm),
           6 * t * d + 8 * d, 0)
    res = a.randn("res", (t, d), bf16)
    yield ("rms_norm_bwd + residual (as the layers call it)",
           lambda: kc.rms_norm_bwd(ctx, x, w_norm, rstd, dy, dx, dw_norm, residual=res),
           8 * t * d + 8 * d, 0)

    w1 = a.randn("w1", (f, d), bf16, d ** -0.5)
    w2 = a.randn("w2", (d, f), bf16, f ** -0.5)
    gate = a.randn("gate", (t, f), bf16)
    dh = a.randn("dh", (t, f), bf16)
    dw1_f32 = cupy.zeros((f, d), f32)
    dw1_bf16 = cupy.zeros((f, d), bf16)
    mm = 2 * t * d * f
    yield "linear_fwd x@W1.T (8192x4096 -> 14336)", lambda: kc.linear_fwd(ctx, x, w1, gate), 0, mm
    yield ("linear_fwd h@W2.T + resid (14336 -> 4096)",
           lambda: kc.linear_fwd(ctx, gate, w2, y, True), 0, mm)
    yield "linear_bwd_x dh@W1 (14336 -> 4096)", lambda: kc.linear_bwd_x(ctx, dh, w1, dx), 0, mm
    yield "linear_bwd_w dW1 += dh.T@x (f32)", lambda: kc.linear_bwd_w(ctx, dh, x, dw1_f32), 0, mm
    yield "linear_bwd_w dW1 += dh.T@x (bf16)", lambda: kc.linear_bwd_w(ctx, dh, x, dw1_bf16), 0, mm
    del dw1_f32, dw1_bf16

    q = a.randn("q", (t, h, e), bf16)
    k = a.randn("k", (t, kh, e), bf16)
    vv = a.randn("v", (t, kh, e), bf16)
    pos = cupy.arange(t, dtype=cupy.int32)
    theta = c["rope_theta"]
    yield ("rope_fwd q in place", lambda: kc.rope_fwd(ctx, q, pos, theta, q),
           4 * t * h * e + 4 * t, 0)
    yield ("rope_bwd q in place", lambda: kc.rope_bwd(ctx, q, pos, theta, q),
           4 * t * h * e + 4 * t, 0)

    up = a.randn("up", (t, f), bf16)
    hh = cupy.empty((t, f), bf16)
    dg, du = cupy.empty((t, f), bf16), cupy.empty((t, f), bf16)
    yield "swiglu_fwd", lambda: kc.swiglu_fwd(ctx, gate, up, hh), 6 * t * f, 0
    yield "swiglu_bwd", lambda: kc.swiglu_bwd(ctx, gate, up, dh, dg, du), 10 * t * f, 0
    del hh, dg, du

    table = a.randn("table", (v, d), bf16)
    ids = a.ints("ids", (t,), v)
    dtable = cupy.zeros((v, d), f32)
    yield "embedding_fwd", lambda: kc.embedding_fwd(ctx, ids, table, y), 4 * t * d + 4 * t, 0
    yield ("embedding_bwd (dtable f32 +=, random ids)",
           lambda: kc.embedding_bwd(ctx, ids, dx, dtable),
           2 * t * d + 8 * t * d + 4 * t, 0)
    del dtable

    o, lse = cupy.empty((t, h, e), bf16), cupy.empty((h, t), f32)
    do = a.randn("do", (t, h, e), bf16)
    dq = cupy.empty((t, h, e), bf16)
    dk, dv = cupy.empty((t, kh, e), bf16), cupy.empty((t, kh, e), bf16)
    attn = 4 * t * t * h * e // 2                     # causal: half the score matrix
    kc.attention_fwd(ctx, q, k, vv, 0, o, lse)
    yield "attention_fwd causal S=8192", lambda: kc.attention_fwd(ctx, q, k, vv, 0, o, lse), 0, attn
    yield ("attention_bwd causal S=8192 (deterministic)",
           lambda: kc.attention_bwd(ctx, q, k, vv, o, lse, do, 0, dq, dk, dv), 0, 5 * attn // 2)
    yield ("attention_bwd causal S=8192 non-deterministic",
           lambda: kc.attention_bwd(ctx, q, k, vv, o, lse, do, 0, dq, dk, dv, deterministic=False),
           0, 5 * attn // 2)
    th = t // 2                                        # second half of a split sequence
    o2, lse2 = cupy.empty((th, h, e), bf16), cupy.empty((h, th), f32)
    q2, do2, dq2 = q[th:], do[th:], cupy.empty((th, h, e), bf16)
    attn2 = 4 * th * th * h * e // 2 + 4 * th * th * h * e  # own triangle + the earlier chunk
    kc.attention_fwd(ctx, q2, k, vv, th, o2, lse2)
    yield ("attention_fwd chunk 4096 @ offset 4096",
           lambda: kc.attention_fwd(ctx, q2, k, vv, th, o2, lse2), 0, attn2)
    yield ("attention_bwd chunk 4096 @ offset 4096",
           lambda: kc.attention_bwd(ctx, q2, k, vv, o2, lse2, do2, th, dq2, dk, dv), 0,
           5 * attn2 // 2)
    del o, lse, dq, dk, dv, o2, lse2, dq2

    yield from _head_and_update_cases(cupy, kc, a, c, x, dx)


def _head_and_update_cases(cupy, kc, a: _Arrays, c: dict, x, dx):
    """_cases' last ones: the head's loss (and its parts), then AdamW and the gradient helpers
    on one layer block. x, dx: _cases' (T, D) bf16 input and gradient buffers."""
    import ml_dtypes
    bf16, f32 = ml_dtypes.bfloat16, cupy.float32
    t, d, h, kh = c["n_tokens"], c["model_dim"], c["n_heads"], c["n_kv_heads"]
    f, v, sub = c["ffn_dim"], c["vocab_size"], c["head_sub_tokens"]
    ctx = a.ctx
    w_head = a.randn("w_head", (v, d), bf16, d ** -0.5)
    targets = a.ints("targets", (t,), v)
    logits = cupy.empty((sub, v), f32)
    dw_head = cupy.zeros((v, d), f32)
    loss = cupy.zeros(2, f32)
    yield ("head_loss_fwd_bwd sub 1024 (dw f32 +=)",
           lambda: kc.head_loss_fwd_bwd(ctx, x, w_head, targets, logits, 1.0 / t, dx, dw_head,
                                        loss),
           0, 3 * 2 * t * d * v)
    dw_head_bf16 = cupy.zeros((v, d), bf16)
    yield ("head_loss_fwd_bwd sub 1024 (dw bf16 +=)",
           lambda: kc.head_loss_fwd_bwd(ctx, x, w_head, targets, logits, 1.0 / t, dx, dw_head_bf16,
                                        loss),
           0, 3 * 2 * t * d * v)
    del dw_head_bf16
    from dataflow.kernels.cuda.head_loss import xent_kernel  # needs CuPy, as kc does
    xent = xent_kernel(ctx, 4)
    tgt_sub = targets[:sub]
    kc.linear_fwd(ctx, x[:sub], w_head, logits)              # real logits to start from

    def xent_only():                # rewrites its input in place: logits hold bf16 after once,
        xent((sub,), (1024,), (logits, np.int32(v), tgt_sub, np.float32(1.0)))  # same traffic
    yield ("  of which: softmax-xent kernel, one sub-chunk", xent_only,
           2 * 4 * sub * v + 2 * sub * v, 0)
    yield ("  of which: logits GEMM, one sub-chunk (f32 out)",
           lambda: kc.linear_fwd(ctx, x[:sub], w_head, logits), 0, 2 * sub * d * v)
    yield ("  of which: dw GEMM, one sub-chunk (f32 +=, k=1024)",
           lambda: kc.linear_bwd_w(ctx, a.randn("dl", (sub, v), bf16), x[:sub], dw_head), 0,
           2 * sub * d * v)
    del logits
    logits2 = cupy.empty((2 * sub, v), f32)
    yield ("head_loss_fwd_bwd sub 2048 (dw f32 +=)",
           lambda: kc.head_loss_fwd_bwd(ctx, x, w_head, targets, logits2, 1.0 / t, dx, dw_head,
                                        loss),
           0, 3 * 2 * t * d * v)
    del logits2, dw_head
    a.free()

    n = 2 * d * d + 2 * d * (d * kh // h) + 3 * d * f + 2 * d   # one 8b layer block
    p = a.randn("p", (n,), bf16, 0.02)
    g = a.randn("g", (n,), f32, 1e-3)
    m = a.randn("m", (n,), bf16, 1e-4)
    v2 = a.randn("v2", (n,), bf16, 1e-4)
    kc.fill_(ctx, v2, 1e-6)                                 # second moments must be positive
    step = [0]

    def adamw():
        step[0] += 1
        kc.adamw_step(ctx, p, g, m, v2, step=step[0], lr=1e-4, weight_decay=0.1)
    yield f"adamw_step layer block n={n} (grad f32)", adamw, n * (2 + 4 + 2 + 2 + 2 + 2 + 2), 0
    gb = a.randn("gb", (n,), bf16)
    yield f"add_ f32 += bf16, n={n}", lambda: kc.add_(ctx, g, gb), n * (4 + 2 + 4), 0
    out = cupy.zeros(1, f32)
    yield f"sumsq bf16, n={n}", lambda: kc.sumsq(ctx, gb, out, accumulate=True), n * 2, 0
    yield f"fill_ bf16, n={n}", lambda: kc.fill_(ctx, gb, 0.5), n * 2, 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        help="JSON record path (default bench/records/kernels-<device>.json)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per op (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per op first")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    try:
        import cupy
    except ImportError:
        print("kernels_bench needs CuPy and an NVIDIA GPU; none here", file=sys.stderr)
        return 2
    import dataflow.kernels.cuda as kc  # needs CuPy: imported once CuPy is known to be here

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rows = []
    arrays = _Arrays(cupy, kc, args.seed)
    for name, fn, nbytes, flop in _cases(cupy, kc, arrays, CONFIG):
        reps = max(3, args.repeats // 3) if flop > 1e13 else args.repeats
        times, host = _time_ms(cupy, fn, args.warmup, reps)
        ms = statistics.median(times)
        row = {"op": name, "ms": ms, "ms_min": min(times), "ms_max": max(times), "repeats": reps,
               "host_ms_per_call": statistics.median(host), "bytes": nbytes, "flop": flop}
        if flop:
            row["tflop_per_s"] = flop / (ms * 1e-3) / 1e12
            row["frac_of_ceiling"] = flop / (ms * 1e-3) / BF16_FLOP_PER_S
        else:
            row["gb_per_s"] = nbytes / (ms * 1e-3) / 1e9
            row["frac_of_ceiling"] = nbytes / (ms * 1e-3) / HBM_BYTES_PER_S
        rows.append(row)
        rate = (f"{row['tflop_per_s']:8.1f} TFLOP/s" if flop else f"{row['gb_per_s']:8.1f} GB/s   ")
        print(f"{name:52s} {ms:9.3f} ms  {rate}  {100 * row['frac_of_ceiling']:5.1f} %  "
              f"host {1e3 * row['host_ms_per_call']:6.0f} us", flush=True)

    try:
        import cudnn
        cudnn_version = f"frontend {cudnn.__version__}, backend {cudnn.backend_version()}"
    except Exception as exc:  # attention fell back or the frontend is absent
        cudnn_version = f"unavailable ({type(exc).__name__})"
    record = {
        "schema_version": 1,
        "kind": "kernels_bench",
        "device": device,
        "commit": _commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": CONFIG,
        "ceilings": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flop_per_s": BF16_FLOP_PER_S},
        "software": {"python": platform.python_version(), "cupy": cupy.__version__,
                     "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cudnn": cudnn_version},
        "method": "CUDA events around each call on the current stream; median of repeats after "
                  "warm-up; bytes = each input read once + each output written once; "
                  "host_ms_per_call = host time to enqueue one call (Python + launch overhead)",
        "attention_fallbacks": {str(k): r for k, r in arrays.ctx.fallbacks().items()},
        "ops": rows,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = pathlib.Path(args.out or pathlib.Path(__file__).resolve().parent / "records" /
                       f"kernels-{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
