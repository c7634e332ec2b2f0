"""Summarise this folder's demo --json files into summary.json (run from the repo root:
python bench/records/session-2026-11-23/summarize.py). Steady state = mean of steps after the
first; prediction = the one the run printed (its step time), else today's
memplan.cost.predict_schedule of the run's plan."""
import glob
import json
import os
import re

from dataflow.memplan.cost import predict_schedule
from dataflow.memplan.plan import Plan

GIB = 1 << 30
here = os.path.dirname(os.path.abspath(__file__))
rows = []
for path in sorted(glob.glob(os.path.join(here, "demo-*.json"))
                   + glob.glob(os.path.join(here, "*", "demo-*.json"))):
    d = json.load(open(path))
    plan = Plan.from_json(json.dumps(d["plan"])) if isinstance(d["plan"], dict) else \
        Plan.from_json(d["plan"])
    steps = d["steps"]
    steady = [s["tok_per_s"] for s in steps[1:]] or [s["tok_per_s"] for s in steps]
    # The prediction the run itself printed (the code of that run), else today's code's.
    log = path[:-5] + ".log"
    m_pred = None
    if os.path.exists(log):
        m_pred = re.search(r"Prediction on .*?: step ([0-9.]+) s", open(log).read())
    pred = (plan.chunking.tokens_per_step / float(m_pred.group(1))) if m_pred else \
        predict_schedule(plan, plan.profile).tok_per_s
    m = d["memory"]
    dev_outside = m["device_used_bytes"] - m["context_baseline_bytes"] - plan.budget.device_bytes
    rows.append(dict(
        file=os.path.relpath(path, here), device=d["device"], model=plan.model.name,
        seqlen=plan.chunking.seqlen, host_gib=plan.budget.host_bytes / GIB,
        dev_gib=plan.budget.device_bytes / GIB, rounds=plan.chunking.rounds_per_step,
        steady_tok_per_s=sum(steady) / len(steady), predicted_tok_per_s=pred,
        predicted_over_measured=pred / (sum(steady) / len(steady)),
        grad_norms=[s["grad_norm"] for s in steps],
        device_used_minus_context_gib=(m["device_used_bytes"] - m["context_baseline_bytes"]) / GIB,
        device_over_budget_gib=dev_outside / GIB,
        outside_arena_gib=m["libraries_and_pool_bytes"] / GIB,
        cudnn_own_workspace_bytes=m.get("cudnn_workspace_bytes"),
        op_scratch_outside_bytes=m.get("op_scratch_bytes"),
        host_rss_gib=m.get("host_rss_bytes", 0) / GIB,
        host_rss_over_budget_gib=(m.get("host_rss_bytes", 0) - plan.budget.host_bytes) / GIB))
json.dump(rows, open(os.path.join(here, "summary.json"), "w"), indent=1)
for r in rows:
    print(f"{r['model']}@{r['seqlen']} {r['host_gib']:.0f}/{r['dev_gib']:.0f}: "
          f"{r['steady_tok_per_s']:,.0f} tok/s measured, {r['predicted_tok_per_s']:,.0f} predicted "
          f"({r['predicted_over_measured']:.3f}); device over budget {r['device_over_budget_gib']:+.2f} "
          f"GiB, RSS over host budget {r['host_rss_over_budget_gib']:+.2f} GiB")
