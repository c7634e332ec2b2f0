"""The 64-replica step of 8b at 80 / 24 (h100 profile, NCCL, 16,384 tokens a replica, split
update) against one device's steady step for the same tokens, as the s37 note cites: each
chunking's compiled prediction with its reduces timed in place, and one device's scaled to
16,384 tokens. Run from the repository root: python bench/records/s37/paper/replica_breakdown.py"""

import dataclasses

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.predict import predict_schedule, reduce_exposure_seconds
from dataflow.memplan.search.ring_plan import LINKS, make_rank_plans, ring_profile
from dataflow.memplan.step.ring_compile import ReplicaCompiler
from dataflow.memplan.step.ring_sim import RingComm
from dataflow.memplan.step.ring_split import GATHER, REDUCE
from dataflow.models.config import load_config

FIELDS = ("step_time_s", "compute_s", "recompute_s", "exposed_h2d_s", "exposed_d2h_s",
          "optimizer_s")
cfg, h100, budget, R, link = load_config("8b"), get_profile("h100"), Budget.from_gib(80, 24), 64, LINKS[0]
one = make_plan(cfg, 8192, budget, h100)
p = predict_schedule(one, h100)
k = 16384 / one.chunking.tokens_per_step
print(f"one device, {one.chunking.chunks_per_round} x {one.chunking.rounds_per_step}, scaled to "
      f"16,384 tokens:", {f: round(getattr(p, f) * k, 3) for f in FIELDS})
prof = ring_profile(h100, R, "nccl", R)
for cpr in (1, 2):
    rp = make_rank_plans(cfg, 8192, budget, prof, 1, replicas=R, tokens_per_step=16384,
                         chunks_per_round=cpr, state_parts=R)[0]
    rp = dataclasses.replace(rp, split_update=True)
    comm = RingComm(rank=0, replicas=R, bytes_per_s=link.bytes_per_s, latency_s=link.latency_s,
                    arrivals=None, streams=(REDUCE, GATHER), reduce=True)
    q = predict_schedule(rp.plan, rp.plan.profile, comm=comm,
                         compiler=lambda n, u, rp=rp: ReplicaCompiler(rp).compile(n, u))
    ch = rp.plan.chunking
    print(f"replica {ch.chunks_per_round} x {ch.rounds_per_step} ({rp.plan.slots}):",
          {f: round(getattr(q, f), 3) for f in FIELDS},
          "reduce added", round(reduce_exposure_seconds(rp, link.bytes_per_s, link.latency_s), 3))
