"""The GEMMs of one transformer layer on one chunk, timed as the engine launches them (separate
Q, K, V and gate, up projections) beside the fused alternatives (one QKV and one gate-up GEMM),
each alone in a burst and the whole layer's sequence sustained for several seconds with the
SM clock and board power sampled, so a gap between the kernels' burst rate and the training
step's GEMM rate can be told apart: small shapes, or a clock the card lowers under load.
Prints a table and writes a JSON record. GPU only.

    python bench/archive/gemm_shapes.py --model 8b --tokens 8192 --out bench/records/gemm-shapes-h100.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from dataflow.bench.sweep.sweep import git_commit


def layer_gemms(d: int, q_out: int, kv_out: int, f: int, fused: bool):
    """(name, kind, out_features, in_features, accumulate) of one layer's forward, input-gradient
    and weight-gradient GEMMs in the engine's order (dataflow.layer_ops); `fused` merges the
    Q/K/V and the gate/up projections into one GEMM each."""
    qkv = [("qkv", q_out + 2 * kv_out)] if fused else [("q", q_out), ("k", kv_out),
                                                      ("v", kv_out)]
    gu = [("gate_up", 2 * f)] if fused else [("gate", f), ("up", f)]
    out = []
    for n, o in qkv:
        out.append((f"fwd.{n}", "fwd", o, d, False))
    out.append(("fwd.o", "fwd", d, q_out, True))
    for n, o in gu:
        out.append((f"fwd.{n}", "fwd", o, d, False))
    out.append(("fwd.down", "fwd", d, f, True))
    out += [("bwd_w.down", "bwd_w", d, f, True), ("bwd_x.down", "bwd_x", d, f, False)]
    for j, (n, o) in enumerate(gu):
        out += [(f"bwd_w.{n}", "bwd_w", o, d, True), (f"bwd_x.{n}", "bwd_x", o, d, j > 0)]
    out += [("bwd_w.o", "bwd_w", d, q_out, True), ("bwd_x.o", "bwd_x", d, q_out, False)]
    for j, (n, o) in enumerate(qkv):
        out += [(f"bwd_w.{n}", "bwd_w", o, d, True), (f"bwd_x.{n}", "bwd_x", o, d, j > 0)]
    return out


class _Sampler:
    """SM clock (MHz) and board power (W) of GPU 0, sampled every 50 ms while running."""

    def __init__(self):
        import pynvml
        pynvml.nvmlInit()
        self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.clock, self.power, self.temp, self._stop = [], [], [], threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        nv = self.nv
        while not self._stop.wait(0.05):
            self.clock.append(nv.nvmlDeviceGetClockInfo(self.h, nv.NVML_CLOCK_SM))
            self.power.append(nv.nvmlDeviceGetPowerUsage(self.h) / 1e3)
            self.temp.append(nv.nvmlDeviceGetTemperature(self.h, nv.NVML_TEMPERATURE_GPU))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        return {"sm_clock_mhz_mean": mean(self.clock), "sm_clock_mhz_min": min(self.clock or [0]),
                "power_w_mean": mean(self.power), "temp_c_max": max(self.temp or [0]),
                "samples": len(self.clock)}


class _Copies:
    """256 MiB pinned-host <-> device copies queued on two streams (one each way) for about
    `seconds`, timed with events: the PCIe traffic a streaming step runs beside its GEMMs."""

    CHUNK = 256 << 20

    def __init__(self, cp, seconds: float):
        self.cp = cp
        self.n = max(1, int(seconds * 55e9 / self.CHUNK))  # outlasts the GEMMs
        self.host = [cp.cuda.alloc_pinned_memory(self.CHUNK) for _ in range(2)]
        self.dev = [cp.cuda.alloc(self.CHUNK) for _ in range(2)]
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
        self.ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(2)]

    def start(self) -> None:
        for way, (s, (e0, _)) in enumerate(zip(self.streams, self.ev)):
            e0.record(s)
            for _ in range(self.n):
                dst, src = ((self.dev[0].ptr, self.host[0].ptr) if way == 0
                            else (self.host[1].ptr, self.dev[1].ptr))
                self.cp.cuda.runtime.memcpyAsync(dst, src, self.CHUNK, 1 if way == 0 else 2,
                                                 s.ptr)

    def finish(self) -> dict:
        out = {}
        for name, s, (e0, e1) in zip(("h2d", "d2h"), self.streams, self.ev):
            e1.record(s)
            e1.synchronize()
            sec = self.cp.cuda.get_elapsed_time(e0, e1) / 1e3
            out[f"{name}_gb_per_s"] = self.n * self.CHUNK / sec / 1e9
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the chunk (T)")
    ap.add_argument("--reps", type=int, default=20, help="burst repetitions per GEMM")
    ap.add_argument("--seconds", type=float, default=8.0, help="sustained run per variant")
    ap.add_argument("--copies", action="store_true",
                    help="also run each sustained variant with host-to-device and device-to-host "
                         "copies of pinned memory streaming beside it, as a training step has")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    from dataflow.kernels.cuda import CudaContext
    from dataflow.kernels.cuda.linear import linear_bwd_w, linear_bwd_x, linear_fwd
    from dataflow.models.config import load_config

    ctx = CudaContext()  # the kernels' handles and caches for this benchmark

    cfg = load_config(a.model)
    d, f, t = cfg.model_dim, cfg.ffn_dim, a.tokens
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rnd = cp.random.default_rng(0)
    widest = max(2 * f, q_out + 2 * kv_out, d)

    def randn(shape):
        return (rnd.standard_normal(shape, dtype=cp.float32) * 0.1).astype(bf16)

    # One buffer per role, big enough for every shape; the GEMMs read fresh random values.
    w = randn((widest * max(d, f, q_out),))
    x, y = randn((t * widest,)), randn((t * widest,))
    g = randn((widest * max(d, f, q_out),))

    def launcher(kind, o, i, acc):
        if kind == "fwd":
            args = (x[:t * i].reshape(t, i), w[:o * i].reshape(o, i), y[:t * o].reshape(t, o))
            return lambda: linear_fwd(ctx, *args, acc)
        if kind == "bwd_x":
            args = (y[:t * o].reshape(t, o), w[:o * i].reshape(o, i), x[:t * i].reshape(t, i))
            return lambda: linear_bwd_x(ctx, *args, acc)
        args = (y[:t * o].reshape(t, o), x[:t * i].reshape(t, i), g[:o * i].reshape(o, i))
        return lambda: linear_bwd_w(ctx, *args, acc)

    def timed(fns, reps):
        for fn in fns:
            fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            for fn in fns:
                fn()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps

    rows, variants = [], {}
    for fused in (False, True):
        seq = layer_gemms(d, q_out, kv_out, f, fused)
        fns, flops = [], []
        for name, kind, o, i, acc in seq:
            fn = launcher(kind, o, i, acc)
            sec = timed([fn], a.reps)
            fl = 2.0 * t * o * i
            fns.append(fn)
            flops.append(fl)
            if not fused or name.split(".")[1] in ("qkv", "gate_up"):
                rows.append({"gemm": name, "fused": fused, "M": t, "N": o, "K": i,
                             "accumulate": acc, "seconds": sec, "tflops": fl / sec / 1e12})
        one = timed(fns, 2)
        reps = max(1, int(a.seconds / one))
        for copies in (False, True) if a.copies else (False,):
            link = _Copies(cp, a.seconds) if copies else None
            with _Sampler() as s:
                if link:
                    link.start()
                sec = timed(fns, reps)
                gbs = link.finish() if link else {}
            key = ("fused" if fused else "separate") + (" + copies" if copies else "")
            variants[key] = {"layer_seconds": sec, "tflops": sum(flops) / sec / 1e12,
                             "reps": reps, **s.summary(), **gbs}

    print(f"{'gemm':16s} {'N':>6s} {'K':>6s} {'ms':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['gemm'] + (' *' if r['fused'] else ''):16s} {r['N']:6d} {r['K']:6d} "
              f"{r['seconds'] * 1e3:8.3f} {r['tflops']:8.1f}")
    print(f"\n{'layer, sustained':20s} {'ms':>8s} {'TFLOP/s':>8s} {'SM MHz':>7s} {'min':>6s} "
          f"{'W':>5s} {'C':>4s} {'h2d GB/s':>9s} {'d2h GB/s':>9s}")
    for k, v in variants.items():
        print(f"{k:20s} {v['layer_seconds'] * 1e3:8.3f} {v['tflops']:8.1f} "
              f"{v['sm_clock_mhz_mean']:7.0f} {v['sm_clock_mhz_min']:6d} {v['power_w_mean']:5.0f} "
              f"{v['temp_c_max']:4d} {v.get('h2d_gb_per_s', 0):9.1f} {v.get('d2h_gb_per_s', 0):9.1f}")
    out = {"bench": "gemm_shapes", "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "commit": git_commit() or "unknown", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "model": a.model, "tokens": t, "reps": a.reps, "seconds": a.seconds,
           "gemms": rows, "layer": variants}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
