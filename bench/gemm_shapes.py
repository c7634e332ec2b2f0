"""The GEMMs of one transformer layer on one chunk, timed as the engine launches them (separate
Q, K, V and gate, up projections) beside the fused alternatives (one QKV and one gate-up GEMM),
each alone in a burst and the whole layer's sequence sustained for several seconds with the
SM clock and board power sampled, so a gap between the kernels' burst rate and the training
step's GEMM rate can be told apart: small shapes, or a clock the card lowers under load.
Prints a table and writes a JSON record. GPU only.

    python -m bench.gemm_shapes --model 8b --tokens 8192 --out bench/records/gemm-shapes-h100.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from bench.sweep.sweep import git_commit


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
        self.clock, self.power, self._stop = [], [], threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        nv = self.nv
        while not self._stop.wait(0.05):
            self.clock.append(nv.nvmlDeviceGetClockInfo(self.h, nv.NVML_CLOCK_SM))
            self.power.append(nv.nvmlDeviceGetPowerUsage(self.h) / 1e3)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        return {"sm_clock_mhz_mean": mean(self.clock), "sm_clock_mhz_min": min(self.clock or [0]),
                "power_w_mean": mean(self.power), "samples": len(self.clock)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the chunk (T)")
    ap.add_argument("--reps", type=int, default=20, help="burst repetitions per GEMM")
    ap.add_argument("--seconds", type=float, default=8.0, help="sustained run per variant")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    from kernels.cuda.linear import linear_bwd_w, linear_bwd_x, linear_fwd
    from models.config import load_config

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
            return lambda: linear_fwd(*args, acc)
        if kind == "bwd_x":
            args = (y[:t * o].reshape(t, o), w[:o * i].reshape(o, i), x[:t * i].reshape(t, i))
            return lambda: linear_bwd_x(*args, acc)
        args = (y[:t * o].reshape(t, o), x[:t * i].reshape(t, i), g[:o * i].reshape(o, i))
        return lambda: linear_bwd_w(*args, acc)

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
        with _Sampler() as s:
            sec = timed(fns, reps)
        variants["fused" if fused else "separate"] = {
            "layer_seconds": sec, "tflops": sum(flops) / sec / 1e12, "reps": reps, **s.summary()}

    print(f"{'gemm':16s} {'N':>6s} {'K':>6s} {'ms':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['gemm'] + (' *' if r['fused'] else ''):16s} {r['N']:6d} {r['K']:6d} "
              f"{r['seconds'] * 1e3:8.3f} {r['tflops']:8.1f}")
    print(f"\n{'layer, sustained':16s} {'ms':>8s} {'TFLOP/s':>8s} {'SM MHz':>7s} {'min':>6s} "
          f"{'W':>5s}")
    for k, v in variants.items():
        print(f"{k:16s} {v['layer_seconds'] * 1e3:8.3f} {v['tflops']:8.1f} "
              f"{v['sm_clock_mhz_mean']:7.0f} {v['sm_clock_mhz_min']:6d} {v['power_w_mean']:5.0f}")
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
