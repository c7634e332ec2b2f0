"""An MoE model's gradients against transformers, tensor by tensor, on a batch where no token's
top-k choice is near a tie (issue 55): a small OLMoE or Qwen3-MoE shape built and saved by
transformers (random init, the routers scaled up so routing has margins), a batch drawn until
every token of every layer keeps its k-th and (k+1)-th router logits at least --margin
apart in transformers' fp32 forward (--margin, 0.03 by default: bf16 rounding moves logits
by ~1e-2), then one step on each side from the same bf16 weights.
Ours come from AdamW's first moment after step 1 (m = (1 - beta1) g: no clipping, bf16 storage,
so 2^-9 of each value); theirs from torch autograd on the same objective (the language-model
loss over the row's first seqlen positions plus coef x the load-balancing loss of that one
forward call, as this engine forms it in one round). Prints, per kind of tensor, the worst
relative error ||ours - theirs|| / ||theirs|| over the layers, and each side against the
engine's NumPy reference trainer (dataflow.reference_trainer: the engine's math in fp32 with its
bf16 storage points, gradients summed in float64; tests check its objective against central
differences), and writes the whole table as JSON. A flipped top-k choice would make the router's and the next norm's gradients differ at
the percent level; with none, they agree as the dense tensors do. Needs torch and transformers
(never dependencies of the project); runs on the CPU (NumPy backend) and on a GPU (--backend
cupy).

    python -m dataflow.bench.moe_grad_check --family olmoe --rows 2 [--backend numpy]
    python -m dataflow.bench.moe_grad_check --family llama --rows 2   # the dense baseline
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from dataflow.bench.family_check import DEV_GB, FAMILIES, MOE_FAMILIES, SHAPE, hf_model
from dataflow.models.init import ModelWeights
from dataflow.reference_trainer import ReferenceTrainer

BETA1 = 0.9
"""The engine's AdamW beta1 (dataflow.optimizer.AdamW's default): m after step 1 is
(1 - BETA1) x the gradient."""


def _margins(model, torch, tokens) -> float:
    """The smallest gap between the k-th and (k+1)-th router logit of any token in any layer,
    in the model's fp32 forward of `tokens` (B, S): the distance to a flipped top-k choice (the
    probabilities are monotone in the logits, so equal logits are the tie)."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(tokens, output_router_logits=True).router_logits
    gaps = []
    for lg in logits:
        z = lg.float().sort(dim=-1, descending=True).values
        gaps.append((z[:, k - 1] - z[:, k]).min().item())
    return min(gaps)


def _theirs(model, torch, batch, coef: float) -> dict:
    """({transformers' parameter name: fp64 gradient}, lm, aux) of lm + coef x aux on `batch`
    (B, S + 1)."""
    t = torch.as_tensor(batch)
    model.zero_grad()
    res = model(t[:, :-1], **({"output_router_logits": True} if coef else {}))
    lm = torch.nn.functional.cross_entropy(res.logits.float().reshape(-1, res.logits.shape[-1]),
                                           t[:, 1:].reshape(-1))
    (lm + coef * res.aux_loss if coef else lm).backward()
    grads = {n: p.grad.double().numpy() for n, p in model.named_parameters()
             if p.grad is not None}
    return grads, lm.item(), float(res.aux_loss.detach()) if coef else None


def _ours_named(eng) -> dict:
    """{transformers' checkpoint name: fp64 gradient} read from AdamW's m after step 1."""
    out = {}
    for ref in eng.block_refs():
        lay = eng.layout(ref)
        m = eng.read_block(ref, "m").astype(np.float64) / (1.0 - BETA1)
        for t in lay.tensors:
            out[lay.full_name(t.name, ref.layer)] = lay.view(m, t.name)
    return out


def _reference_named(eng, batch) -> dict:
    """{checkpoint name: gradient} of the engine's NumPy reference trainer (fp32 math, bf16
    storage points, float64 sums) on the engine's weights before the step: a third opinion."""
    refs = eng.block_refs()
    blocks = [eng.read_block(r, "weights") for r in refs]
    cfg = eng.plan.model
    w = ModelWeights(cfg, blocks[0], blocks[1:-1], blocks[-1])
    tr = ReferenceTrainer(cfg, w, lr=1e-4, grad_accum_dtype=np.float64)
    _, _, grads = tr.accumulate_grads(batch)
    out = {}
    for r, g in zip(refs, grads):
        lay = eng.layout(r)
        for t in lay.tensors:
            out[lay.full_name(t.name, r.layer)] = lay.view(np.asarray(g, np.float64), t.name)
    return out


def _per_expert(theirs: dict) -> dict:
    """transformers 5's fused expert gradients split into the checkpoint's per-expert names."""
    out = {}
    for name, g in theirs.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem, f = name[:-len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = g[e, :f]
                out[f"{stem}{e}.up_proj.weight"] = g[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[:-len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


def _kind(name: str) -> str:
    """'router', 'experts.gate_proj', 'post_attention_layernorm', ... : a name without its
    layer and expert index."""
    parts = [p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers",
                                                                         "weight")]
    kind = ".".join(parts)
    return "router" if kind == "mlp.gate" else kind.replace("mlp.", "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.moe_grad_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="olmoe", choices=FAMILIES,
                   help="an MoE family, or a dense one for the bf16 baseline of the same table")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--seqlen", type=int, default=32)
    p.add_argument("--router-scale", type=float, default=8.0,
                   help="multiply transformers' router init by this (margins; default 8)")
    p.add_argument("--margin", type=float, default=0.03,
                   help="the smallest gap between the k-th and (k+1)-th router logit a batch "
                        "may have (default 0.03: bf16 activations move logits of magnitude ~2 "
                        "by ~1e-2, so a smaller gap can still flip on our side)")
    p.add_argument("--tries", type=int, default=400, help="batches drawn at most")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences in the step (default: the engine's plan)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"moe_grad_check needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    # the engine loads numba and ml_dtypes (about 2 s): imported once the arguments are parsed
    from dataflow.engine import Engine

    torch.manual_seed(0)
    ref = hf_model(args.family, torch)
    with torch.no_grad():
        for name, prm in ref.named_parameters():
            if name.endswith("mlp.gate.weight"):
                prm.mul_(args.router_scale)
            elif name.endswith("layernorm.weight"):  # generic norm weights, not all ones
                prm.copy_(1.0 + 0.2 * torch.randn_like(prm))
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))  # our storage's bits
    tmp = Path(tempfile.mkdtemp())
    ref.save_pretrained(tmp / "hf", safe_serialization=True)
    ref = ref.float().train()
    moe = args.family in MOE_FAMILIES
    coef = float(ref.config.router_aux_loss_coef) if moe else 0.0
    with Engine(str(tmp / "hf"), host_gb=1, dev_gb=DEV_GB[args.backend == "numpy"],
                seqlen=args.seqlen, backend=args.backend, lr=1e-4, max_grad_norm=None, seed=0,
                plan_options={"rounds_per_step": 1},
                **({"seqs_per_step": args.rows} if args.rows else {})) as eng:
        rows = eng.seqs_per_step
        rng = np.random.default_rng(1)
        best, batch = -1.0, None
        for _ in range(args.tries):
            cand = rng.integers(0, SHAPE["vocab_size"], (rows, args.seqlen + 1))
            if not moe:  # no routing: any batch
                best, batch = float("inf"), cand
                break
            gap = _margins(ref, torch, torch.as_tensor(cand[:, :-1]))
            if gap > best:
                best, batch = gap, cand
            if best >= args.margin:
                break
        oracle = _reference_named(eng, batch)
        r = eng.train_step(batch)
        ours = _ours_named(eng)
    theirs, lm_theirs, aux_theirs = _theirs(ref, torch, batch, coef)
    theirs = _per_expert(theirs)
    missing = sorted(set(theirs) ^ set(ours))
    table: dict[str, dict] = {}
    for name, g in theirs.items():
        if name not in ours:
            continue
        o, f = ours[name].reshape(g.shape), oracle[name].reshape(g.shape)
        rel = float(np.linalg.norm(o - g) / max(np.linalg.norm(g), 1e-30))
        row = table.setdefault(_kind(name), {"worst": 0.0, "worst_tensor": "", "count": 0,
                                             "worst_ours_vs_reference": 0.0,
                                             "worst_transformers_vs_reference": 0.0})
        row["count"] += 1
        if rel >= row["worst"]:
            row["worst"], row["worst_tensor"] = rel, name
        scale = max(np.linalg.norm(f), 1e-30)
        row["worst_ours_vs_reference"] = max(row["worst_ours_vs_reference"],
                                       float(np.linalg.norm(o - f) / scale))
        row["worst_transformers_vs_reference"] = max(row["worst_transformers_vs_reference"],
                                               float(np.linalg.norm(g - f) / scale))
    out = {"family": args.family, "backend": args.backend, "seqlen": args.seqlen, "rows": rows,
           "router_scale": args.router_scale, "min_topk_logit_gap": best if moe else None,
           "margin_asked": args.margin, "tie_free": best >= args.margin if moe else None,
           "loss_ours": r.loss, "loss_transformers": lm_theirs,
           "aux_ours": r.aux_loss if moe else None, "aux_transformers": aux_theirs,
           "router_aux_loss_coef": coef,
           "names_not_on_both_sides": missing, "per_kind": table}
    print(f"{args.family} on {args.backend}, {rows} x {args.seqlen} tokens: " + (
        f"smallest top-k logit gap {best:.2e} "
        f"({'tie-free' if best >= args.margin else 'NOT tie-free'} at {args.margin:g})"
        if moe else "dense (no routing)"))
    print(f"loss {r.loss:.6f} ours, {lm_theirs:.6f} transformers" + (
        f"; aux {r.aux_loss:.6f} ours, {aux_theirs:.6f} transformers" if moe else ""))
    print(f"{'tensor kind':<28} {'count':>5} {'ours-theirs':>11} {'ours-ref':>9} "
          f"{'theirs-ref':>10}  worst tensor (ours against theirs)")
    for kind, row in sorted(table.items(), key=lambda kv: -kv[1]["worst"]):
        print(f"{kind:<28} {row['count']:>5} {row['worst']:>11.2e} "
              f"{row['worst_ours_vs_reference']:>9.2e} {row['worst_transformers_vs_reference']:>10.2e}  "
              f"{row['worst_tensor']}")
    if missing:
        print(f"names on one side only: {missing[:6]}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
