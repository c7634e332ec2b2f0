"""Every execution plan cuDNN offers for the engine's fused-attention shapes, timed: which
engine and knobs the heuristics pick (what dataflow.kernels.cuda.attention runs) against the others
heuristic modes A, B and FALLBACK list, so a faster plan the default walk misses shows up.
Prints a table and writes a JSON record. GPU only.

    python bench/archive/attention_plans.py --out bench/records/attention-plans-h100.json
    python bench/archive/attention_plans.py --cases 8b-bwd-block,1b-fwd --reps 5
"""

from __future__ import annotations

import argparse
import json
import time

from dataflow.bench.sweep.sweep import git_commit

# name: (kind, model, T queries, S keys, q_offset, causal, deterministic) — the shapes the
# long-context plans run (8,192-token chunks; key blocks of dataflow.memplan.plan.buffers.attention_key_block)
CASES = {
    "8b-fwd-8k": ("fwd", "8b", 8192, 8192, 0, True, True),
    "8b-bwd-8k-det": ("bwd", "8b", 8192, 8192, 0, True, True),
    "8b-bwd-8k": ("bwd", "8b", 8192, 8192, 0, True, False),
    "8b-fwd-128k": ("fwd", "8b", 8192, 131072, 122880, True, True),
    "8b-bwd-diag-32k": ("bwd", "8b", 8192, 32768, 24576, True, False),
    "8b-bwd-block-32k": ("bwd", "8b", 8192, 32768, 0, False, False),
    "1b-fwd-512k": ("fwd", "1b", 8192, 524288, 516096, True, True),
    "1b-fwd-self-16k": ("fwd", "1b", 16384, 16384, 0, True, True),
    "1b-fwd-diag-96k": ("fwd", "1b", 16384, 98304, 81920, True, True),
    "1b-fwd-block-96k": ("fwd", "1b", 16384, 98304, 0, False, True),
    "8b-fwd-block-32k": ("fwd", "8b", 8192, 32768, 0, False, True),
    "1b-bwd-diag-96k": ("bwd", "1b", 8192, 98304, 90112, True, False),
    "1b-bwd-block-96k": ("bwd", "1b", 8192, 98304, 0, False, False),
}


def _flops(kind, t, s, q_offset, causal, h, e) -> float:
    """Hardware FLOPs of one call: 4*H*E per visible (query, key) pair forward, 2.5x that
    backward (the same count bench/archive/attention_blocks.py uses)."""
    pairs = t * s if not causal else t * q_offset + t * (t + 1) / 2
    fwd = 4.0 * h * e * pairs
    return fwd if kind == "fwd" else 2.5 * fwd


def _plans_finish(cudnn, g):
    """dataflow.kernels.cuda.attention._finish without the build: every heuristic mode's plans listed."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-workspace-gb", type=float, default=8.0)
    ap.add_argument("--kernel-cfgs", default="",
                    help="also time the default plan's engine at these KERNEL_CFG knob values "
                         "(e.g. 0-63): plans the heuristics do not list")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes
    import numpy as np

    from dataflow.kernels.cuda import CudaContext
    from dataflow.kernels.cuda import attention as A
    from dataflow.models.config import load_config

    cudnn = A._cudnn()
    ctx = CudaContext()  # the cuDNN handle the graphs are built and run with
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rnd = cp.random.default_rng(0)

    def randn(shape):
        return rnd.standard_normal(shape, dtype=cp.float32).astype(bf16)

    records = []
    for name in a.cases.split(","):
        kind, model, t, s, off, causal, det = CASES[name]
        cfg = load_config(model)
        h, kh, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        mask = ("bottom_right" if off > 0 else "top_left") if causal else "none"
        q, o, do = randn((t, h, e)), randn((t, h, e)), randn((t, h, e))
        k, v = randn((s, kh, e)), randn((s, kh, e))
        lse = rnd.standard_normal((h, t), dtype=cp.float32) + 5.0
        dq = cp.empty((t, h, e), bf16)
        dk, dv = cp.empty((s, kh, e), bf16), cp.empty((s, kh, e), bf16)
        pack = {A._UID_Q: q.data.ptr, A._UID_K: k.data.ptr, A._UID_V: v.data.ptr,
                A._UID_O: o.data.ptr, A._UID_STATS: lse.data.ptr}
        if kind == "bwd":
            pack.update({A._UID_DO: do.data.ptr, A._UID_DQ: dq.data.ptr, A._UID_DK: dk.data.ptr,
                         A._UID_DV: dv.data.ptr})
            g = A._build_bwd(ctx, t, s, h, kh, e, mask, det, "band", finish=_plans_finish)
        else:
            g = A._build_fwd(ctx, t, s, h, kh, e, mask, "band", finish=_plans_finish)
        flops = _flops(kind, t, s, off, causal, h, e)
        n = g.get_execution_plan_count()
        info = {}
        if a.kernel_cfgs:
            eid, _ = g.get_engine_and_knobs_at_index(0)
            try:
                info["engine_knobs"] = str(g.get_knobs_for_engine(eid))
            except Exception as exc:  # noqa: BLE001 - informative only
                info["engine_knobs"] = f"? {type(exc).__name__}: {exc}"
            print(name, "engine", eid, "knobs", info["engine_knobs"][:300], flush=True)
            lo, hi = (int(x) for x in a.kernel_cfgs.split("-"))
            for val in range(lo, hi + 1):
                try:
                    g.create_execution_plan(eid, {cudnn.knob_type.KERNEL_CFG: val})
                except Exception:  # noqa: BLE001 - a value the engine refuses
                    continue
        rows = []
        for i in range(g.get_execution_plan_count()):
            row = {"index": i}
            try:
                row["plan"] = g.get_plan_name_at_index(i)
            except Exception as exc:  # noqa: BLE001 - report, keep going
                row["plan"] = f"? {type(exc).__name__}"
            try:
                eid, knobs = g.get_engine_and_knobs_at_index(i)
                row["engine"], row["knobs"] = int(eid), {str(kk): int(vv) for kk, vv in
                                                         dict(knobs or {}).items()}
            except Exception:  # noqa: BLE001 - names are informative only
                pass
            try:
                g.build_plan_at_index(i)
                ws_bytes = int(g.get_workspace_size())
                row["workspace_bytes"] = ws_bytes
                if ws_bytes > a.max_workspace_gb * 2**30:
                    row["error"] = "workspace over --max-workspace-gb"
                    rows.append(row)
                    continue
                ws = cp.empty(max(ws_bytes, 16), cp.uint8)
                handle = A._handle(ctx)
                g.execute(pack, ws.data.ptr, handle=handle)
                cp.cuda.Device().synchronize()
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for _ in range(a.reps):
                    g.execute(pack, ws.data.ptr, handle=handle)
                end.record()
                end.synchronize()
                sec = cp.cuda.get_elapsed_time(start, end) / 1e3 / a.reps
                row["seconds"] = sec
                row["tflops"] = flops / sec / 1e12
                del ws
            except Exception as exc:  # noqa: BLE001 - a plan that does not build is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(f"{name:18s} {i:3d} {row.get('tflops', 0):7.1f} TF/s  "
                  f"ws {row.get('workspace_bytes', 0) / 2**20:8.1f} MiB  {row['plan'][:70]}"
                  + (f"  ERR {row['error'][:60]}" if "error" in row else ""), flush=True)
        records.append({"case": name, "kind": kind, "model": model, "T": t, "S": s,
                        "q_offset": off, "causal": causal, "deterministic": det,
                        "flops": flops, "listed_by_heuristics": n, **info, "plans": rows})
        del q, o, do, k, v, lse, dq, dk, dv
        cp.get_default_memory_pool().free_all_blocks()

    print(f"\n{'case':18s} {'plans':>5s} {'default TF/s':>12s} {'best TF/s':>10s}  best plan")
    for r in records:
        timed = [p for p in r["plans"] if "tflops" in p]
        first = timed[0]["tflops"] if timed else 0.0
        best = max(timed, key=lambda p: p["tflops"]) if timed else {"tflops": 0, "plan": "-"}
        print(f"{r['case']:18s} {len(r['plans']):5d} {first:12.1f} {best['tflops']:10.1f}  "
              f"{best['plan'][:60]}")
    out = {"bench": "attention_plans",
           "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "commit": git_commit() or "unknown", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "cudnn_backend": str(cudnn.backend_version()), "frontend": cudnn.__version__,
           "reps": a.reps, "records": records}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
