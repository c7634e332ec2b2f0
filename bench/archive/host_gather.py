"""The host embedding gather of a HOME embedding (dataflow.executor's 'embed_gather' host task:
bf16 rows of the table picked by the round's token ids into pinned staging), timed with NumPy's
take in its default mode='raise' and in mode='clip' (what the executor uses), with the Python
heap's peak (tracemalloc) during each. Host-only: runs anywhere, no GPU.

    python bench/archive/host_gather.py --out bench/records/host-gather-cpu.json
    python bench/archive/host_gather.py --model 8b --tokens 16384,131072

Prints a table last and writes one JSON record (machine, commit, config, numbers). Never
changes what it measures: the same call as the executor, on random ids of the round's size."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

MODES = ("raise", "clip")


def measure(table: np.ndarray, n_tokens: int, mode: str, repeats: int, rng) -> dict:
    ids = rng.integers(0, table.shape[0], n_tokens, dtype=np.int32)
    out = np.empty((n_tokens, table.shape[1]), table.dtype)
    np.take(table, ids, axis=0, out=out, mode=mode)  # first touch of out, outside the timing
    times = []
    tracemalloc.start()
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.take(table, ids, axis=0, out=out, mode=mode)
        times.append(time.perf_counter() - t0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(out, table[ids])
    best = min(times)
    return {"mode": mode, "tokens": n_tokens, "rows_bytes": out.nbytes, "best_s": best,
            "median_s": float(np.median(times)), "gb_per_s": out.nbytes / best / 1e9,
            "heap_peak_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/archive/host_gather.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", help="zoo model whose table shape to use")
    p.add_argument("--tokens", default="16384,131072",
                   help="tokens per round, comma-separated (8b at 8k: 16384; at 128k: 131072)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the JSON record here")
    args = p.parse_args(argv)

    import ml_dtypes

    from dataflow.bench.sweep.sweep import git_commit
    from dataflow.models.hf_config import model_config

    cfg = model_config(args.model)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((cfg.vocab_size, cfg.model_dim), np.float32).astype(
        ml_dtypes.bfloat16)
    rows = [measure(table, int(t), mode, args.repeats, rng)
            for t in args.tokens.split(",") for mode in MODES]
    record = {"schema": "host_gather/1", "commit": git_commit(),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version(),
                          "numpy": np.__version__},
              "config": {"model": args.model, "vocab": cfg.vocab_size, "dim": cfg.model_dim,
                         "repeats": args.repeats},
              "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    print(f"{'tokens':>8} {'mode':>6} {'rows MiB':>9} {'best ms':>9} {'GB/s':>7} {'heap MiB':>9}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['mode']:>6} {r['rows_bytes'] / 2**20:>9.0f} "
              f"{r['best_s'] * 1e3:>9.1f} {r['gb_per_s']:>7.2f} {r['heap_peak_bytes'] / 2**20:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
