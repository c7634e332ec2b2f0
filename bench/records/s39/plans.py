"""The plan pairs of the thirty-ninth session's few-rounds pick (memplan.search.search,
RESCORED_CHUNKINGS): for each request, the plan make_plan chose before (the best chunking by the
search's estimate, no compiled rescoring) and the one it chooses now, as plan JSON for
`dataflow-demo ... --plan`, with their compiled predictions in pairs.json. CPU only.

    python bench/records/s39/plans.py
"""

from __future__ import annotations

import json
import pathlib

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.search.search import batch_chunkings
from dataflow.models.config import load_config

HERE = pathlib.Path(__file__).resolve().parent / "plans"
REQUESTS = (("8b", 8192, 80, 24, 16_384), ("8b", 4096, 80, 24, 16_384))


def estimates_pick(cfg, seqlen, budget, profile, tokens):
    """make_plan's pick before: each chunking's best plan (the resident cap at every layer, which
    is no cap, so nothing is rescored), the fastest by the search's estimate."""
    plans = [make_plan(cfg, seqlen, budget, profile, tokens_per_step=tokens, chunk_tokens=t,
                       chunks_per_round=c, rounds_per_step=r, max_resident_layers=cfg.n_layers)
             for t, c, r in batch_chunkings(cfg, seqlen, tokens // seqlen, {})]
    return max(plans, key=lambda p: p.prediction.tok_per_s)


def shape(plan) -> str:
    ch = plan.chunking
    return (f"{ch.chunk_tokens} x {ch.chunks_per_round} a round, {ch.rounds_per_step} rounds, "
            f"{plan.resident_layers} resident")


def main() -> None:
    HERE.mkdir(exist_ok=True)
    profile, out = get_profile("h100"), []
    for model, seqlen, host, dev, tokens in REQUESTS:
        cfg, budget = load_config(model), Budget.from_gib(host, dev)
        pair = {"estimate": estimates_pick(cfg, seqlen, budget, profile, tokens),
                "compiled": make_plan(cfg, seqlen, budget, profile, tokens_per_step=tokens)}
        row = {"request": f"{model} {seqlen} {host}/{dev} tokens_per_step {tokens}"}
        for name, plan in pair.items():
            f = HERE / f"{model}-{seqlen}-{tokens}-{name}.json"
            f.write_text(plan.to_json())
            row[name] = {"file": f.name, "shape": shape(plan),
                         "compiled_tok_per_s": round(predict_schedule(plan, profile).tok_per_s),
                         "estimate_tok_per_s": round(plan.prediction.tok_per_s)}
        out.append(row)
        print(f"{row['request']}: " + "; ".join(
            f"{k} {row[k]['shape']} {row[k]['compiled_tok_per_s']:,}" for k in pair))
    (HERE / "pairs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
