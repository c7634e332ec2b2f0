"""Host <-> device bandwidth of every GPU of a machine, alone and with all GPUs copying at once
(issues 38/39: rings on multi-GPU H100 hosts ran 0.80-0.89 of the model, which takes each
rank's PCIe rate from a one-GPU probe). One process per GPU (spawned, like the ring's ranks),
each with a pinned host buffer and a device buffer of --mib; the phases run in lock step
(a barrier between them):

  alone     each GPU in turn copies while the others wait: H2D, then D2H, then both at once
  together  every GPU copies at once: H2D, then D2H, then both at once

Each copy phase repeats --reps copies of the buffer on CUDA streams (one per direction) and
takes the wall time from the first launch to the last synchronise. The record (--out, JSON)
holds the device names, the rates per GPU and phase, their sums and each GPU's together/alone
ratio; the short table comes last. `nvidia-smi topo -m` beside it says which GPUs share a
PCIe switch or a CPU socket.

    python -m dataflow.bench.pcie_shared --out runs/pcie.json [--mib 512] [--reps 8]

Never runs a model; never creates a CUDA context in the launching process."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

PHASES = ("h2d", "d2h", "both")


def _copy_rate(cp, host, dev, phase: str, reps: int, streams) -> float:
    """Bytes per second moved by `reps` copies in `phase` (both directions counted)."""
    nbytes = dev.nbytes
    up, down = streams
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        if phase in ("h2d", "both"):
            dev.set(host, stream=up)
        if phase in ("d2h", "both"):
            dev.get(out=host, stream=down)
    up.synchronize()
    down.synchronize()
    dt = time.perf_counter() - t0
    return nbytes * reps * (2 if phase == "both" else 1) / dt


def _rank(gpu: int, ngpu: int, nbytes: int, reps: int, barrier, q) -> None:
    import cupy as cp
    import numpy as np

    cp.cuda.Device(gpu).use()
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    host[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # touch every page
    # Separate device buffers per direction: "both" reads and writes different memory.
    dev = cp.empty(nbytes, dtype=cp.uint8)
    streams = (cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True))
    for phase in PHASES:  # warm-up: first-touch mappings, DMA engines awake
        _copy_rate(cp, host, dev, phase, 1, streams)
    rates = {}
    for phase in PHASES:
        for turn in range(ngpu):
            barrier.wait()
            if turn == gpu:
                rates[f"alone_{phase}"] = _copy_rate(cp, host, dev, phase, reps, streams)
        barrier.wait()
        rates[f"together_{phase}"] = _copy_rate(cp, host, dev, phase, reps, streams)
    q.put({"gpu": gpu, "name": cp.cuda.runtime.getDeviceProperties(gpu)["name"].decode(),
           "rates": rates})


def _gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return len([line for line in out.splitlines() if line.strip()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.pcie_shared",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record")
    p.add_argument("--mib", type=float, default=512.0, help="buffer per GPU, MiB")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--gpus", type=int, default=None, help="default: every GPU nvidia-smi lists")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps < 1:
        p.error(f"--mib {args.mib} and --reps {args.reps}: both must be positive")
    ngpu = args.gpus or _gpu_count()
    nbytes = int(args.mib * 2**20)
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(ngpu)
    procs = [ctx.Process(target=_rank, args=(g, ngpu, nbytes, args.reps, barrier, q))
             for g in range(ngpu)]
    for pr in procs:
        pr.start()
    try:
        rows = sorted((q.get(timeout=300) for _ in procs), key=lambda r: r["gpu"])
    except Exception:  # noqa: BLE001 - a process died or hung: say which, exit 1
        codes = [pr.exitcode for pr in procs]
        for pr in procs:
            pr.kill()
        print(f"pcie_shared: no result within 300 s (exit codes {codes})", file=sys.stderr)
        return 1
    for pr in procs:
        pr.join(60)
    sums = {k: sum(r["rates"][k] for r in rows) for k in rows[0]["rates"]}
    rec = {"kind": "pcie_shared", "gpus": ngpu, "devices": [r["name"] for r in rows],
           "buffer_bytes": nbytes, "reps": args.reps, "per_gpu": rows, "sums": sums,
           "together_over_alone": {f"gpu{r['gpu']}_{ph}": r["rates"][f"together_{ph}"] /
                                   r["rates"][f"alone_{ph}"] for r in rows for ph in PHASES},
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
    print(f"{ngpu} x {rows[0]['name']}, {nbytes / 2**20:g} MiB x {args.reps} copies (GB/s)")
    print("  gpu " + "".join(f"{'alone ' + ph:>12}{'together ' + ph:>15}" for ph in PHASES))
    for r in rows:
        print(f"  {r['gpu']:>3} " + "".join(
            f"{r['rates']['alone_' + ph] / 1e9:>12.1f}{r['rates']['together_' + ph] / 1e9:>15.1f}"
            for ph in PHASES))
    print("  sum " + "".join(f"{sums['alone_' + ph] / 1e9:>12.1f}{sums['together_' + ph] / 1e9:>15.1f}"
                             for ph in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
