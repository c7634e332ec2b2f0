"""Device memory NCCL holds per process, and what it costs to hold less (issue 38: a ring rank's
plan reserves ring_plan.nccl_reserve_bytes, 1 GiB for a world of 2, out of its device budget,
and on 2 H200s at 60/24 that reserve alone is most of what keeps 2 replicas of 8b below 1.9x one
GPU: their recompute is the reserve's). Two processes (spawned, one GPU each, like the ring's
ranks) per variant; each variant is a number of 2-rank communicators (a data-parallel pair holds
2: the world and the replicas'; a ring of 2 holds 3: the world and two directed pairs) and the
NCCL environment it is created under (NCCL reads it once, at first use, so every variant is a
fresh pair of processes). Per process: NVML's device memory after the CUDA context, after the
communicators are made, and after each has run an all-reduce and an in-place all-gather (NCCL
allocates some buffers at first use); and the seconds of a 256 MiB bf16 all-reduce (what fewer
channels cost). The record (--out, JSON) holds every variant; the short table comes last.

    python -m dataflow.bench.nccl_memory --out runs/nccl_memory.json

Never runs a model; never creates a CUDA context in the launching process. NCCL_NVLS_ENABLE=0
in every variant (NVLink multicast stays off: KINDS.md)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

from dataflow.ring.nccl import communicator_from_id, uid_bytes

VARIANTS = (
    ("1 communicator", 1, {}),
    ("2 communicators (replicas)", 2, {}),
    ("3 communicators (ring of 2)", 3, {}),
    ("2, NCCL_BUFFSIZE 1 MiB", 2, {"NCCL_BUFFSIZE": str(1 << 20)}),
    ("2, at most 4 channels", 2, {"NCCL_MAX_CTAS": "4", "NCCL_MAX_NCHANNELS": "4"}),
)
"""(name, communicators, environment) of every variant."""

REDUCE_BYTES = 256 << 20


def _used(handle, pid: int) -> int:
    import pynvml

    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == pid:
            return int(p.usedGpuMemory or 0)
    return 0


def _rank(rank: int, n_comms: int, ids_q, out_q, barrier) -> None:
    import cupy as cp
    import pynvml
    from cupy.cuda import nccl

    pynvml.nvmlInit()
    cp.cuda.Device(rank).use()
    handle = pynvml.nvmlDeviceGetHandleByIndex(rank)
    cp.zeros(1)
    cp.cuda.Device().synchronize()
    pid = os.getpid()
    context = _used(handle, pid)
    buf = cp.ones(REDUCE_BYTES // 2, cp.float16).view(cp.uint16)  # outside NCCL's share
    cp.cuda.Device().synchronize()
    base = _used(handle, pid)

    if rank == 0:
        ids = [uid_bytes(nccl.get_unique_id()) for _ in range(n_comms)]
        ids_q.put(ids)
        ids_q.put(ids)
    ids = ids_q.get()
    barrier.wait()
    comms = [communicator_from_id(nccl, 2, uid, rank) for uid in ids]
    cp.cuda.Device().synchronize()
    made = _used(handle, pid)
    stream = cp.cuda.Stream(non_blocking=True)
    n = buf.size
    for comm in comms:
        comm.allReduce(buf.data.ptr, buf.data.ptr, n, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                       stream.ptr)
        part = buf.nbytes // 2  # in place: rank r's send buffer is its part of the receive one
        comm.allGather(buf.data.ptr + rank * part, buf.data.ptr, part, nccl.NCCL_UINT8,
                       stream.ptr)
    stream.synchronize()
    used = _used(handle, pid)
    t0 = time.perf_counter()
    for _ in range(5):
        comms[0].allReduce(buf.data.ptr, buf.data.ptr, n, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                           stream.ptr)
    stream.synchronize()
    reduce_s = (time.perf_counter() - t0) / 5
    barrier.wait()
    for comm in comms:
        comm.destroy()
    out_q.put({"rank": rank, "context_bytes": context, "made_bytes": made - base,
               "used_bytes": used - base, "allreduce_256mib_s": reduce_s})


def run_variant(name: str, n_comms: int, env: dict, timeout_s: float = 120.0) -> dict:
    saved = {k: os.environ.get(k) for k in (*env, "NCCL_NVLS_ENABLE")}
    os.environ.update(env, NCCL_NVLS_ENABLE="0")
    ctx = mp.get_context("spawn")
    ids_q, out_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(r, n_comms, ids_q, out_q, barrier))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        rows = sorted((out_q.get(timeout=timeout_s) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"variant": name, "communicators": n_comms, "env": env, "ranks": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.nccl_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record")
    args = p.parse_args(argv)
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout.split("\n")[:2]
    record = {"devices": names, "variants": []}
    for name, n, env in VARIANTS:
        try:
            record["variants"].append(run_variant(name, n, env))
        except Exception as exc:  # noqa: BLE001 - a record without it, and why
            record["variants"].append({"variant": name, "error": str(exc)[:300]})
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{'variant':<30} {'made GiB':>9} {'after use GiB':>14} {'256 MiB all-reduce ms':>22}")
    for v in record["variants"]:
        if "error" in v:
            print(f"{v['variant']:<30} error: {v['error'][:60]}")
            continue
        made = max(r["made_bytes"] for r in v["ranks"]) / 2**30
        used = max(r["used_bytes"] for r in v["ranks"]) / 2**30
        ms = max(r["allreduce_256mib_s"] for r in v["ranks"]) * 1e3
        print(f"{v['variant']:<30} {made:>9.3f} {used:>14.3f} {ms:>22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
