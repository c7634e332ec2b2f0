"""Compare bench.trace_ops records of fp8 current against guessed scales (s37 run1)."""
import sys

import json, os
out = sys.argv[1]
for model in ("m112", "8b"):
    runs = {}
    for s in ("current", "guessed"):
        try:
            runs[s] = json.load(open(f"{out}/{model}-{s}.ops.json"))
        except Exception as e:  # noqa: BLE001
            print(f"{model} {s}: {e!r}"[:160])
    if len(runs) < 2:
        continue
    c, g = runs["current"], runs["guessed"]
    print(f"{model}: step wall ms current {c['wall_ms']:,.1f}, guessed {g['wall_ms']:,.1f}; "
          f"compute idle {c['compute_idle_ms']:,.1f} vs {g['compute_idle_ms']:,.1f}")
    for stream in c["streams"]:
        a = {r["op"]: r["total_ms"] for r in c["streams"][stream]}
        b = {r["op"]: r["total_ms"] for r in g["streams"].get(stream, [])}
        diffs = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)),
                       key=lambda x: -abs(x[0]))
        print(f"  {stream}: guessed - current, largest: "
              + ", ".join(f"{k} {d:+.1f} ms" for d, k in diffs[:6]))
