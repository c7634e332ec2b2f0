"""The figures behind the thirty-second session's compiled layout figures (docs/ring.md,
"Compiled figures for replicas"): every CuPy run recorded under bench/records/s2*-s3*, its own
plan re-predicted by today's model both ways (the search's estimate, cost.predict, and the
compiled schedule, predict_schedule) against its measured step; one device's 8b at 80 / 24 at
several global batches both ways; and the ranks of the 64-GPU choice (gpus64.json) both ways.
Writes search_vs_compiled.json beside itself. CPU only.

    python bench/records/s32/plan-compiled/search_vs_compiled.py
"""

from __future__ import annotations

import dataclasses
import glob
import json
import pathlib

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.memplan.search.build import finish_plan
from dataflow.memplan.search.cost import predict
from dataflow.memplan.search.predict import predict_schedule
from dataflow.models.config import load_config

HERE = pathlib.Path(__file__).resolve().parent
RECORDS = HERE.parents[1]


def recorded_runs() -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(RECORDS / "*" / "call*" / "**" / "*.demo.json"),
                              recursive=True)):
        d = json.loads(pathlib.Path(f).read_text())
        if d.get("backend") != "cupy" or len(d.get("steps", [])) < 2:
            continue
        plan = Plan.from_json(json.dumps(d["plan"]))
        again = finish_plan(decisions_of(plan), plan.budget, plan.profile)
        m = d["steps"][-1]["tok_per_s"]
        out.append({"record": str(pathlib.Path(f).relative_to(RECORDS)),
                    "rounds": plan.chunking.rounds_per_step, "measured": m,
                    "search": predict(again, again.profile).tok_per_s,
                    "compiled": predict_schedule(again, again.profile).tok_per_s})
    return out


def one_device() -> list[dict]:
    cfg, prof = load_config("8b"), get_profile("h100")
    out = []
    for tps in (65_536, 131_072, 262_144, 524_288, 1_048_576, None):
        plan = make_plan(cfg, 8192, Budget.from_gib(80, 24), prof,
                         **({"tokens_per_step": tps} if tps else {}))
        out.append({"tokens_per_step": plan.chunking.tokens_per_step,
                    "rounds": plan.chunking.rounds_per_step,
                    "search": predict(plan, prof).tok_per_s,
                    "compiled": predict_schedule(plan, prof).tok_per_s})
    return out


def ring_ranks() -> list[dict]:
    d = json.loads((HERE / "gpus64.json").read_text())
    out = []
    for r in d["ranks"]:
        plan = Plan.from_json(json.dumps(r["plan"]))
        whole = plan if plan.state_parts == 1 else dataclasses.replace(plan, state_parts=1)
        out.append({"rank": r["rank"], "rounds": plan.chunking.rounds_per_step,
                    "search_step_s": predict(whole, plan.profile).step_time_s,
                    "compiled_step_s": predict_schedule(whole, plan.profile).step_time_s})
    return out


def main() -> None:
    runs = recorded_runs()
    err = {k: sum(abs(r["measured"] / r[k] - 1) for r in runs) / len(runs)
           for k in ("search", "compiled")}
    record = {"runs": runs, "mean_abs_error": err, "one_device_8b_80_24_h100": one_device(),
              "ring_of_4_ranks_64_gpus": ring_ranks()}
    (HERE / "search_vs_compiled.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{len(runs)} recorded CuPy runs: mean |measured / predicted - 1| search "
          f"{err['search']:.2%}, compiled {err['compiled']:.2%}")
    for r in record["one_device_8b_80_24_h100"]:
        print(f"8b 80/24 {r['tokens_per_step']:>9,} tokens ({r['rounds']:>2} rounds): search "
              f"{r['search']:,.0f} compiled {r['compiled']:,.0f} tok/s")
    for r in record["ring_of_4_ranks_64_gpus"]:
        print(f"64-GPU ring rank {r['rank']}: search {r['search_step_s']:.3f} s, compiled "
              f"{r['compiled_step_s']:.3f} s")


if __name__ == "__main__":
    main()
