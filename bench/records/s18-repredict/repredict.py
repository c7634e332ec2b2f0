"""Eighteenth session: every ring / replica run of s17 and s18 re-predicted with the current model
(SHARED_HOST_COPY_EFFICIENCY, OVERFULL_RING_EFFICIENCY), beside the prediction its record holds.
Run from the repository root: python bench/records/s18-repredict/repredict.py > .../repredict.txt
"""
import json, sys, types
from dataflow.bench.ring_gpu import predicted
runs = [
 ("s18 A dp2 (H100)", "bench/records/s18-ring-h100x2-0eaca45/dp2", "8b", 2, (60,24)),
 ("s18 A 32b ring2 (H100)", "bench/records/s18-ring-h100x2-0eaca45/r32b2", "32b", 2, (120,40)),
 ("s18 C ring2 (H200)", "bench/records/s18-ring-h200x2-63164c4/dp2", "8b", 2, (60,24)),
 ("s18 D dp2 traced (H100)", "bench/records/s18-ring-h100x2-77ade76/dp2", "8b", 2, (60,24)),
 ("s17 I 8b ring4 4x4k (H100)", "bench/records/s17-ring-h100x4-cc8d78a/auto4", "8b", 4, (30,24)),
 ("s17 G 8b ring4 8x8k (H100)", "bench/records/s17-ring-h100x4-92311e8/auto4", "8b", 4, (30,24)),
 ("s17 F 32b ring4 (H100)", "bench/records/s17-ring-h100x4-1644192/r32b4", "32b", 4, (64,40)),
 ("s17 F 32b ring2 (H100)", "bench/records/s17-ring-h100x4-1644192/r32b2", "32b", 2, (120,40)),
]
rows = []
for label, d, model, gpus, budget in runs:
    try:
        rec = json.load(open(f"{d}/ring_gpu.json"))
    except FileNotFoundError:
        print(label, "no record"); continue
    rank0 = json.load(open(f"{d}/ring/rank0.json"))
    args = types.SimpleNamespace(backend="cupy", model=model, seqlen=8192, link_bytes_per_s=None,
                                 ring_budget=budget, gpus=gpus, no_single=True)
    p = predicted(args, rec["devices"], rank0)
    meas = rec["comparison"]["ring_tok_per_s"] if rec.get("comparison") else None
    old = rec["predicted"]["tok_per_s"]
    rows.append({"run": label, "record": d, "measured": meas, "predicted_then": old,
                 "predicted_now": p["tok_per_s"]})
    print(f"{label:30s} meas {meas:8.0f} old pred {old:8.0f} ({meas/old:.3f}) new pred {p['tok_per_s']:8.0f} ({meas/p['tok_per_s']:.3f})")
json.dump(rows, open("bench/records/s18-repredict/repredict.json", "w"), indent=1)
