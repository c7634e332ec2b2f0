"""measured / predicted of recorded demo runs (mean of steps 2+) with today's compiled model;
CPU only:
    python bench/records/s40/calib.py > bench/records/s40/calib.txt"""
import json, sys
from pathlib import Path
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import Plan
from dataflow.memplan.search.build import finish_plan
from dataflow.memplan.search.predict import predict_schedule
R = Path("bench/records")
RUNS = [f"s26-fp8/{run}.json" for run in (
    "call2/8b-fp8", "call2/8b-bf16", "call3/1b-fp8", "call3/1b-bf16", "call3/8b64k-fp8",
    "call3/8b64k-bf16", "call4/1b-fp8", "call5/8b-fp8")] + [
    "s33/call1/bf16/8b-s8192-h80-d24.demo.json",
    *(f"s34/call2/{run}.demo.json" for run in ("fp8-8b", "bf16-8b", "fp8-1b", "bf16-1b")),
    "s37/call1/8b-current.json", "s37/call1/8b-guessed.json", "s37/call2/8b-bf16.json",
    "s38/call2/65k-bf16.json", "s38/call2/65k-fp8.json",
    *(f"s40/call2/8b-{s}-16384-{k}.json" for s in (8192, 4096) for k in ("estimate", "compiled")),
    "s40/call3/8b-131072-262144.json"]
rows = []
for run in RUNS:
    f = R / run
    if not f.exists():
        print("missing", run); continue
    rec = json.loads(f.read_text())
    plan = Plan.from_json(json.dumps(rec["plan"]))
    again = finish_plan(decisions_of(plan), plan.budget, plan.profile)
    pred = predict_schedule(again, again.profile)
    steps = rec["steps"][1:] or rec["steps"]
    meas = sum(s["tok_per_s"] for s in steps) / len(steps)
    ch = plan.chunking
    print(f"{run:48s} {plan.profile.name:5s} R{ch.rounds_per_step:<2d} meas {meas:8,.0f} "
          f"pred {pred.tok_per_s:8,.0f} ratio {meas / pred.tok_per_s:.3f}")
