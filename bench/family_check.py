"""A model family against transformers' own class, end to end: a small non-zoo shape built and
saved by transformers (`save_pretrained`, random init), trained here from that directory (the
NumPy or CuPy backend) and by transformers with torch's AdamW in fp32 on the same batches:
step-1 loss and gradient norm, an 8-step loss trajectory; then our export reloaded with
`from_pretrained`: its loss on a held-out batch against ours on the same weights, and its logits
against transformers' own trained model (which trained in fp32). Needs torch and transformers
(never dependencies of the project); runs on the CPU too.

    python -m dataflow.bench.family_check --family mistral|llama|qwen2|qwen3|olmoe|qwen3_moe
                                          [--tied] [--backend numpy] [--out FILE]

--tied builds the model with tie_word_embeddings=True (Llama 3.2 1B/3B, Qwen2.5 0.5B-3B): it
must load here tied (one parameter), train as transformers trains its shared Parameter, and
export tied (no lm_head.weight), reloading as a tied model.

transformers initialises biases to zero and norm weights to one; Qwen2's q/k/v biases and
Qwen3's q_norm/k_norm weights are redrawn at random here (randomise_family_params), so their
gradients and updates are checked for real.

olmoe and qwen3_moe (issue 41) build OlmoeForCausalLM / Qwen3MoeForCausalLM with 4 experts, top
2, output_router_logits=True and aux coefficients far above the released ones (so the router's
share of the gradient shows); one round a step on our side, so both sides' load-balancing loss
covers the same rows (one forward call). transformers' loss then includes coef x aux: the
trajectories compare the language-model losses (theirs minus coef x aux) and, beside them, the
auxiliary losses; the export's held-out loss is compared likewise (its loss minus coef x aux).
transformers freezes the embedding row of `pad_token_id` (nn.Embedding's padding_idx: OLMoE's
config sets 1), which this engine trains (s19: the step-1 gradient norm then differs, on that row
alone; the losses do not). torch and transformers install on the CPU machine from its local
index (a venv of their own, never the project's).

Prints one JSON document (and writes it to --out)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)
"""Not a zoo shape: GQA 4:1, head_dim 16, an FFN width that is not a power of two."""

DEV_GB = (2.0, 0.5)
"""Device budget (GPU, NumPy): on a GPU the plan adds 0.75 GiB for the CUDA libraries
(memplan.profiles.LIBRARY_RESERVE_BYTES), which 0.5 GiB cannot hold."""


def hf_model(family: str, torch, tied: bool = False):
    """A transformers model of `family` at SHAPE (randomly initialised by transformers; seed
    torch first): the reference the family, MoE-gradient and peft checks compare against."""
    import transformers

    shape = dict(SHAPE, tie_word_embeddings=tied)
    if family == "mistral":
        conf = transformers.MistralConfig(**shape, sliding_window=None)
        return transformers.MistralForCausalLM(conf)
    if family == "llama":
        conf = transformers.LlamaConfig(**shape)
        return transformers.LlamaForCausalLM(conf)
    if family == "qwen2":
        conf = transformers.Qwen2Config(**shape, use_sliding_window=False)
        return transformers.Qwen2ForCausalLM(conf)
    if family == "qwen3":
        conf = transformers.Qwen3Config(**shape, attention_bias=False, use_sliding_window=False)
        return transformers.Qwen3ForCausalLM(conf)
    if family == "olmoe":  # head_dim is hidden / heads there (16, as SHAPE's)
        conf = transformers.OlmoeConfig(**{k: v for k, v in shape.items() if k != "head_dim"},
                                        **MOE_SHAPE, norm_topk_prob=False, clip_qkv=None,
                                        router_aux_loss_coef=0.2, output_router_logits=True)
        return transformers.OlmoeForCausalLM(conf)
    if family == "qwen3_moe":
        conf = transformers.Qwen3MoeConfig(**shape, **MOE_SHAPE, norm_topk_prob=True,
                                           moe_intermediate_size=SHAPE["intermediate_size"],
                                           decoder_sparse_step=1, mlp_only_layers=[],
                                           attention_bias=False, use_sliding_window=False,
                                           router_aux_loss_coef=0.1, output_router_logits=True)
        return transformers.Qwen3MoeForCausalLM(conf)
    raise SystemExit(f"family {family!r}: choose one of {', '.join(FAMILIES)}")


FAMILIES = ("mistral", "llama", "qwen2", "qwen3", "olmoe", "qwen3_moe")
MOE_FAMILIES = ("olmoe", "qwen3_moe")
MOE_SHAPE = dict(num_experts=4, num_experts_per_tok=2)


def randomise_family_params(model, torch) -> None:
    """Qwen2's q/k/v biases ~ normal(0, 0.1) and Qwen3's q_norm/k_norm weights ~ 1 +
    normal(0, 0.1), where transformers starts them at zero and one (seeded by the caller)."""
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("_proj.bias"):
                prm.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                prm.copy_(1.0 + 0.1 * torch.randn_like(prm))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.family_check")
    p.add_argument("--family", default="mistral", choices=FAMILIES)
    p.add_argument("--tied", action="store_true",
                   help="tie_word_embeddings=True: the head is the embedding (one parameter)")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"family_check needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    # the engine loads numba and ml_dtypes (about 2 s): imported once the arguments are parsed
    from dataflow.engine import Engine
    from dataflow.models.safetensors_io import SafetensorsFile  # ml_dtypes: likewise

    dev = "cuda" if torch.cuda.is_available() and args.backend != "numpy" else "cpu"
    torch.manual_seed(0)
    ref = hf_model(args.family, torch, args.tied)
    randomise_family_params(ref, torch)
    # bf16 weights on both sides: ours store bf16, so the reference starts from the same bits
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
    tmp = Path(tempfile.mkdtemp())
    ref.save_pretrained(tmp / "hf", safe_serialization=True)
    ref = ref.to(dev).float().train()
    opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    rng = np.random.default_rng(1)
    moe = args.family in MOE_FAMILIES
    aux_coef = float(getattr(ref.config, "router_aux_loss_coef", 0.0)) if moe else 0.0
    out = {"family": args.family, "tied": args.tied, "backend": args.backend,
           "shape": {**SHAPE, "tie_word_embeddings": args.tied, **(MOE_SHAPE if moe else {})},
           "seqlen": args.seqlen, "lr": args.lr, "ours": [], "transformers": [],
           "ours_grad_norm": [], "transformers_grad_norm": []}
    if moe:
        out.update(router_aux_loss_coef=aux_coef, ours_aux=[], transformers_aux=[])
    with Engine(str(tmp / "hf"), host_gb=1, dev_gb=DEV_GB[args.backend == "numpy"], seqlen=args.seqlen,
                backend=args.backend, lr=args.lr, max_grad_norm=None, seed=0,
                plan_options={"rounds_per_step": 1} if moe else None) as eng:
        out["family_loaded"] = eng.plan.model.family
        out["tied_loaded"] = eng.plan.model.tie_embeddings
        rows = eng.seqs_per_step
        for _ in range(args.steps):
            batch = rng.integers(0, SHAPE["vocab_size"], (rows, args.seqlen + 1))
            r = eng.train_step(batch)
            out["ours"].append(r.loss)
            out["ours_grad_norm"].append(r.grad_norm)
            t = torch.as_tensor(batch).to(dev)
            opt.zero_grad()
            # transformers shifts inside: given the whole row of seqlen + 1 tokens its targets
            # are t[:, 1:], exactly ours (the last token's logits are computed and unused)
            res = ref(t, labels=t)
            loss = res.loss
            loss.backward()
            norm = torch.sqrt(sum((q.grad.float() ** 2).sum() for q in ref.parameters()
                                  if q.grad is not None))
            opt.step()
            lm = loss.item()
            if moe:  # theirs is lm + coef x aux: compare the language-model parts
                aux = float(res.aux_loss)
                lm -= aux_coef * aux
                out["transformers_aux"].append(aux)
                out["ours_aux"].append(r.aux_loss)
            out["transformers"].append(lm)
            out["transformers_grad_norm"].append(norm.item())
        eng.save_pretrained(tmp / "ours")
        probe = rng.integers(0, SHAPE["vocab_size"], (rows, args.seqlen + 1))
        out["ours_eval_loss"] = eng.eval_step(probe)
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ours",
                                                             torch_dtype=torch.float32)
    out["exported_class"] = type(back).__name__
    out["exported_tied"] = bool(back.config.tie_word_embeddings) and \
        back.get_output_embeddings().weight is back.get_input_embeddings().weight
    if args.tied:
        names = [n for f in sorted((tmp / "ours").glob("*.safetensors"))
                 for n in SafetensorsFile(f).names()]
        out["exported_has_lm_head"] = "lm_head.weight" in names
    trained = ref.eval()
    with torch.no_grad():
        pt = torch.as_tensor(probe).to(dev)
        back = back.to(dev).eval()
        a = back(pt).logits.float()
        b = trained(pt).logits.float()
        res = back(pt, labels=pt)
        # an MoE model's loss adds coef x its load-balancing loss: ours is the LM's alone
        out["export_eval_loss"] = res.loss.item() - (
            aux_coef * float(res.aux_loss) if moe and res.aux_loss is not None else 0.0)
    out["logits_rel_diff_export_vs_transformers_trained"] = float((a - b).norm() / b.norm())
    out["export_eval_loss_rel_diff_vs_ours"] = abs(out["export_eval_loss"] -
                                                   out["ours_eval_loss"]) / out["ours_eval_loss"]
    rel = [abs(x - y) / y for x, y in zip(out["ours"], out["transformers"])]
    out["loss_rel_diff"] = rel
    out["step1_loss_rel_diff"] = rel[0]
    out["grad_norm_rel_diff_step1"] = abs(out["ours_grad_norm"][0] -
                                          out["transformers_grad_norm"][0]) / \
        out["transformers_grad_norm"][0]
    if moe:
        out["aux_rel_diff"] = [abs(x - y) / y for x, y in zip(out["ours_aux"],
                                                               out["transformers_aux"])]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
