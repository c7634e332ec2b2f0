"""Nineteenth session: the model's figures the issue 38 note cites, at the tree it runs on.
2 data-parallel replicas of 8b at 60/24 against one GPU at 120/24 with the same chunking, by
rounds a replica; a replica's and one GPU's per-round parts at 16k x 16 rounds; the layout the
planner chooses for 2 GPUs. Run: python bench/records/s19-ring-model/ratios.py (CPU, no GPU)."""
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.search.layout import choose_layout, layout_text, predict_layout
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.ring_plan import make_rank_plans, ring_profile
from dataflow.models.config import load_config

cfg = load_config("8b")
for gpu in ("h200", "h100"):
    prof = get_profile(gpu)
    c = choose_layout(cfg, 8192, Budget.from_gib(60, 24), prof, 2)
    o = c.chosen
    print(layout_text(c).split("\n")[2])
    for rounds in (16, 32, o.rounds_per_step):
        r = predict_layout(cfg, 8192, Budget.from_gib(60, 24), prof, 2, 1,
                           chunk_tokens=o.chunk_tokens, chunks_per_round=o.chunks_per_round,
                           rounds_per_step=rounds).on("nvlink").tok_per_s
        s = make_plan(cfg, 8192, Budget.from_gib(120, 24), prof, chunk_tokens=o.chunk_tokens,
                      chunks_per_round=o.chunks_per_round, rounds_per_step=2 * rounds)
        print(f"{gpu} {o.chunk_tokens} x {rounds} rounds: replicas {r:,.0f} one GPU "
              f"{s.prediction.tok_per_s:,.0f} ratio {r / s.prediction.tok_per_s:.3f}")
    rp = make_rank_plans(cfg, 8192, Budget.from_gib(60, 24), ring_profile(prof, 2, "nccl", 2),
                         1, replicas=2, rounds_per_step=16)[0]
    one = make_plan(cfg, 8192, Budget.from_gib(120, 24), prof, chunk_tokens=16384,
                    chunks_per_round=1, rounds_per_step=32)
    for name, p, n in (("replica 16k x 16", rp.plan, 16), ("one GPU 16k x 32", one, 32)):
        q = p.prediction
        print(f"{gpu} {name}: {q.step_time_s / n:.3f} s a round, recompute "
              f"{q.recompute_s / n:.3f}, optimizer {q.optimizer_s:.2f} s a step, "
              f"{q.tok_per_s * (2 if n == 16 else 1):,.0f} tok/s (x2 for the replicas)")
