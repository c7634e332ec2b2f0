"""How the planner's search time grows with the layer count (issue 51's MAX_PLAN_LAYERS): tiny's
shape with N layers at seqlen 128, budgets 1/0.25 GiB, the CPU profile, as the demo plans it.
Run from a checkout: python bench/records/s23-restructure/plan_time.py OUT.json. 2,048 layers
is planned past the bound by calling the search below make_plan's size check."""

import dataclasses
import json
import platform
import subprocess
import sys
import time

from dataflow.memplan import get_profile
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search import search
from dataflow.models.config import load_config

GIB = 2 ** 30
rows = []
for n in (2, 128, 512, 1024, 2048):
    cfg = dataclasses.replace(load_config("tiny"), n_layers=n)
    budget = Budget(host_bytes=1 * GIB, device_bytes=GIB // 4)
    bound, search.MAX_PLAN_LAYERS = search.MAX_PLAN_LAYERS, max(search.MAX_PLAN_LAYERS, n)
    t0 = time.perf_counter()
    try:
        search.make_plan(cfg, 128, budget, get_profile("cpu"))
        status = "planned"
    except Exception as exc:  # noqa: BLE001 - an infeasible cell is a row, not a crash
        status = f"{type(exc).__name__}"
    finally:
        search.MAX_PLAN_LAYERS = bound
    rows.append({"n_layers": n, "plan_s": round(time.perf_counter() - t0, 2), "status": status})
    print(f"{n:>6} layers: {rows[-1]['plan_s']:>6.2f} s ({status})", flush=True)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
json.dump({"kind": "plan_time", "device": f"cpu ({platform.processor() or platform.machine()},"
           " the session's 2-core machine)", "commit": commit, "model": "tiny", "seqlen": 128,
           "budget_gib": [1, 0.25], "profile": "cpu", "rows": rows}, open(sys.argv[1], "w"),
          indent=1)
