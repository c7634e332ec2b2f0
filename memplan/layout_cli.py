"""`dataflow-plan ... --gpus N`: the layout chosen for N GPUs (replicas of a ring, from
memplan.layout) with the alternatives it weighed, the chosen ring's per-device plans, its
predicted throughput over each link, the same choice for N = 2..64, and the ring-only scaling
model. Text or one JSON document. Pure Python; never imports array libraries."""

from __future__ import annotations

import json

from dataflow.memplan.search.layout import LayoutChoice, choose_layout, layout_text
from dataflow.memplan.search.ring_plan import LINKS, scaling, scaling_text
from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json

GPU_COUNTS = (2, 4, 8, 16, 32, 64)
GIB = 2 ** 30


def _global_batch(args) -> int | None:
    if getattr(args, "tokens_per_step", None):
        return args.tokens_per_step
    if getattr(args, "seqs_per_step", None):
        return args.seqs_per_step * args.seqlen
    return None


def _link_rows(choice: LayoutChoice) -> list[dict]:
    return [{"link": p.link, "tok_per_s": p.tok_per_s, "speedup": p.speedup,
             "bubble_frac": p.bubble_frac, "step_time_s": p.step_time_s,
             "allreduce_s": p.allreduce_s} for p in choice.chosen.predictions]


def ring_report(cfg, args, budget, profile) -> str:
    """The report of `dataflow-plan ... --gpus N` (text, or JSON with args.json)."""
    cap = _global_batch(args)
    if cap is not None and cap % args.seqlen:
        raise ConfigError(f"--tokens-per-step {cap:,} is not a multiple of seqlen {args.seqlen}")
    memo: dict = {}  # the rings planned, shared by the choices for 2..64 GPUs below
    choice = choose_layout(cfg, args.seqlen, budget, profile, args.gpus, tokens_per_step=cap,
                           memo=memo)
    single = choice.single_tok_per_s
    by_gpus = []
    for g in GPU_COUNTS:
        try:
            c = choice if g == args.gpus else choose_layout(
                cfg, args.seqlen, budget, profile, g, tokens_per_step=cap,
                single_tok_per_s=single, memo=memo, quick=True)
            by_gpus.append((g, c, ""))
        except ConfigError as exc:  # InfeasibleBudget included: say so, go on with other N
            by_gpus.append((g, None, str(exc).split("\n")[0][:160]))
    preds, _, note = scaling(cfg, args.seqlen, budget, profile)
    if args.json:
        return json.dumps({
            **choice.to_json_dict(),
            "ranks": [json.loads(rp.to_json()) for rp in choice.rank_plans],
            "by_gpus": [{"gpus": g, "layout": None if c is None else
                         json.loads(to_json(c.chosen.layout)),
                         "links": None if c is None else _link_rows(c), "refused": why or None}
                        for g, c, why in by_gpus],
            "scaling": [json.loads(to_json(p)) for p in preds], "scaling_note": note},
            sort_keys=True)
    lines = [layout_text(choice)]
    rps = choice.rank_plans
    ch = rps[0].plan.chunking
    lines.append(f"the chosen ring's devices (budgets per device; {ch.chunk_tokens} tokens x "
                 f"{ch.chunks_per_round} chunks x {ch.rounds_per_step} rounds per replica):")
    for rp in rps:
        p = rp.plan
        extra = " + embedding" * rp.has_embed + " + head" * rp.has_head
        lines.append(f"  device {rp.rank}: layers {_layers_text(rp.layers)}{extra}; device "
                     f"{p.memory.device_bytes / GIB:.2f} GiB, host {p.memory.host_bytes / GIB:.2f}"
                     f" GiB; alone it would predict {p.prediction.tok_per_s:,.0f} tok/s")
    lines.append("  predicted over each link:")
    for p in choice.chosen.predictions:
        speed = "n/a" if p.speedup is None else f"{p.speedup:.2f}x"
        lines.append(f"    {p.link:<16} {p.tok_per_s:>12,.0f} tok/s  ({speed}; step "
                     f"{p.step_time_s:.3f} s, all-reduce {p.allreduce_s:.3f} s, bubble "
                     f"{p.bubble_frac:.1%})")
    lines.append(f"layouts by number of GPUs (over {LINKS[0].name}; per-device budgets as above; "
                 f"quick: rings at the planner's chunk size, rounded up to full, except for "
                 f"{args.gpus}; --gpus G weighs smaller chunks too):")
    for g, c, why in by_gpus:
        if c is None:
            lines.append(f"  {g:>3} GPUs: not possible ({why})")
            continue
        o, p = c.chosen, c.chosen.on(c.link)
        speed = "n/a" if p.speedup is None else f"{p.speedup:.2f}x"
        lines.append(f"  {g:>3} GPUs: {o.layout.replicas:>2} x ring of {o.layout.ring_size:<2} "
                     f"{o.layout.tokens_per_step:>12,} tokens/step {p.tok_per_s:>10,.0f} tok/s "
                     f"{speed:>7} bubble {p.bubble_frac:.1%}")
    return "\n".join(lines + ["one ring of N (no replicas), for comparison:",
                              scaling_text(preds, single, note)])


def _layers_text(layers) -> str:
    if len(layers) <= 6:
        return ", ".join(map(str, layers))
    steps = {b - a for a, b in zip(layers, layers[1:])}
    if len(steps) == 1:  # every N-th layer (cyclic), or one block
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]} ({len(layers)})"
    runs = [[layers[0]]]  # a placement with runs of consecutive layers: "14-15"
    for g in layers[1:]:
        if g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) + \
        f" ({len(layers)})"
