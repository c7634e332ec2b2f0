"""The link between two ring neighbours as the engine sees it: two processes (GPU 0 and GPU 1),
each with the ring's own NCCL transport (dataflow.ring.nccl.NcclTransport: one communicator
per directed pair), send a residual-sized message (chunk tokens x model dim x 2 bytes) back and
forth, both directions at once as the ring's forward and backward do, and time it. Run it with
NCCL's defaults (NVLink) or with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (sockets over loopback,
the slow link); the JSON record (--out) holds the environment's NCCL_* variables, the message
size and the one-way rate, which `python -m dataflow.bench.ring_gpu --link-bytes-per-s` and
memplan.ring_plan.Link take as the link to predict for.

    python -m dataflow.bench.link_bandwidth --out runs/link.json [--mib 64] [--reps 20]

Never runs a model; never creates a CUDA context in the launching process."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time

from dataflow.ring.env import RankEnv
from dataflow.ring.nccl import NcclTransport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, nbytes: int, reps: int, q) -> None:
    import cupy as cp

    env = RankEnv(rank=rank, gpus=2, local_rank=rank, master_addr="127.0.0.1",
                  master_port=port, run_id=str(port))
    tr = NcclTransport(env, timeout_s=120)
    out = (cp.arange(nbytes, dtype=cp.uint32) * (2654435761 + rank)).astype(cp.uint8)
    inn = cp.empty(nbytes, cp.uint8)
    peer = 1 - rank
    times = []
    for i in range(reps + 2):  # two warm-up exchanges
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        # Rank 0 sends first and rank 1 receives first: NCCL connects a communicator when both
        # ends first use it, so both sending first would wait on each other forever (the ring's
        # own first messages are matched the same way: a send meets a posted receive).
        if rank == 0:
            tr.send(out, peer, i)
            tr.recv(inn, peer, i)
        else:
            tr.recv(inn, peer, i)
            tr.send(out, peer, i)
        for s in tr.streams.values():
            s.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    sent_back = bool(cp.array_equal(
        inn, (cp.arange(nbytes, dtype=cp.uint32) * (2654435761 + peer)).astype(cp.uint8)))
    tr.close()
    q.put({"rank": rank, "times_s": times, "bytes_intact": sent_back})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.link_bandwidth",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mib", type=float, default=64.0,
                   help="message size, MiB (default 64: one 8192-token chunk of an 8b residual)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    nbytes = int(args.mib * 2**20)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, nbytes, args.reps, q)) for r in (0, 1)]
    for pr in procs:
        pr.start()
    try:
        rows = [q.get(timeout=120) for _ in procs]
    except Exception:  # noqa: BLE001 - a rank died or hung: say which, exit 1
        codes = [pr.exitcode for pr in procs]
        for pr in procs:
            pr.kill()
        print(f"link: no result within 120 s (exit codes {codes})", file=sys.stderr)
        return 1
    for pr in procs:
        pr.join(60)
    times = sorted(max(a, b) for a, b in zip(*(r["times_s"] for r in sorted(
        rows, key=lambda r: r["rank"]))))
    median = times[len(times) // 2]
    rec = {"kind": "link_bandwidth", "message_bytes": nbytes, "reps": args.reps,
           "median_exchange_s": median, "one_way_bytes_per_s": nbytes / median,
           "bytes_intact": all(r["bytes_intact"] for r in rows),
           "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
    print(f"link: {nbytes / 2**20:g} MiB each way at once, median {median * 1e3:.2f} ms: "
          f"{nbytes / median / 1e9:.2f} GB/s one way (both directions busy); bytes intact "
          f"{rec['bytes_intact']}")
    return 0 if rec["bytes_intact"] else 1


if __name__ == "__main__":
    sys.exit(main())
