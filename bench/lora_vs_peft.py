"""LoRA against transformers + peft, end to end (issue 54): for a small non-zoo Llama shape and a
Qwen3 shape (bench.family_check's builders: random init, saved by transformers'
save_pretrained), trains this engine from that directory with LoRA on all seven targets and
transformers + peft (get_peft_model, the same r, alpha, targets; our initial A copied into
peft's modules so both start equal) with torch.optim.AdamW in fp32 (our AdamW's lr, betas, eps
and weight decay) on the same token batches; records step-1 loss, the adapters' gradients after
step 1 (max relative error), the loss trajectory side by side; then exports our adapter as a
PEFT directory, loads it with PeftModel.from_pretrained onto the saved base and compares its
logits with peft's trained model and its loss with ours. Needs torch, transformers and peft
(never dependencies of the project).

    python -m dataflow.bench.lora_vs_peft --out bench/records/lora_vs_peft_h200.json
        [--families llama,qwen3] [--rank 8] [--alpha 16] [--steps 8] [--b-std 0]
        [--backend cupy]

With PEFT's init B is zero, so A's step-1 gradient is exactly zero on both sides (reported as
such); --b-std S starts B from normal(0, S) on both sides too, so A's gradient is checked for
real. Prints one JSON document and writes it to --out. Never decides anything for the engine."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dataflow.bench.family_check import DEV_GB, SHAPE, hf_model, randomise_family_params

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
          "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
          "down": "mlp.down_proj"}


def _peft_modules(pm, n_layers: int):
    """{(layer, target): peft's LoRA Linear} of a get_peft_model model."""
    mods = dict(pm.named_modules())
    return {(i, t): mods[f"base_model.model.model.layers.{i}.{MODULE[t]}"]
            for i in range(n_layers) for t in TARGETS}


def _max_rel(ours: np.ndarray, theirs: np.ndarray) -> float | None:
    """max |ours - theirs| / max |theirs|; None when theirs is all zeros (and ours too)."""
    scale = float(np.abs(theirs).max())
    diff = float(np.abs(ours - theirs).max())
    if scale == 0.0:
        return None if diff == 0.0 else float("inf")
    return diff / scale


def run_family(family: str, args, torch) -> dict:
    """One family's record (see the module docstring)."""
    import peft
    import transformers

    # the engine loads numba and ml_dtypes (about 2 s): imported once the arguments are parsed
    from dataflow.engine import Engine

    dev = "cuda" if torch.cuda.is_available() and args.backend != "numpy" else "cpu"
    torch.manual_seed(0)
    base = hf_model(family, torch)
    randomise_family_params(base, torch)
    with torch.no_grad():  # bf16 weights on both sides: ours store bf16
        for prm in base.parameters():
            prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
    tmp = Path(tempfile.mkdtemp())
    base.save_pretrained(tmp / "hf", safe_serialization=True)
    n_layers = SHAPE["num_hidden_layers"]
    rec = {"family": family, "shape": SHAPE, "rank": args.rank, "alpha": args.alpha,
           "targets": list(TARGETS), "seqlen": args.seqlen, "lr": args.lr, "b_std": args.b_std,
           "ours": [], "peft": []}
    t0 = time.perf_counter()
    rng = np.random.default_rng(1)
    with Engine(str(tmp / "hf"), host_gb=1, dev_gb=DEV_GB[args.backend == "numpy"],
                seqlen=args.seqlen, backend=args.backend, lr=args.lr, betas=(0.9, 0.95),
                eps=1e-8, weight_decay=0.0, max_grad_norm=None, seed=0,
                lora=dict(rank=args.rank, alpha=args.alpha, targets=",".join(TARGETS))) as eng:
        start = {k: v for k, v in eng.lora_state().items() if k.endswith((".a", ".b"))}
        if args.b_std > 0:
            start = {k: (rng.normal(0.0, args.b_std, v.shape).astype(np.float32)
                         if k.endswith(".b") else v) for k, v in start.items()}
            eng.load_lora_state(start)
        conf = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                               bias="none", task_type="CAUSAL_LM",
                               target_modules=[MODULE[t].split(".")[1] for t in TARGETS])
        pm = peft.get_peft_model(base.to(dev).float(), conf).train()
        mods = _peft_modules(pm, n_layers)
        with torch.no_grad():  # both start from our adapters
            for (i, t), m in mods.items():
                m.lora_A["default"].weight.copy_(torch.as_tensor(start[f"layers.{i}.{t}.a"]))
                m.lora_B["default"].weight.copy_(torch.as_tensor(start[f"layers.{i}.{t}.b"]))
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=args.lr,
                                betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        rows = eng.seqs_per_step
        for step in range(args.steps):
            batch = rng.integers(0, SHAPE["vocab_size"], (rows, args.seqlen + 1))
            rec["ours"].append(eng.train_step(batch).loss)
            t = torch.as_tensor(batch).to(dev)
            opt.zero_grad()
            loss = pm(t, labels=t).loss  # transformers shifts: targets t[:, 1:], as ours
            loss.backward()
            if step == 0:
                rec.update(_step1_grads(eng, mods))
            opt.step()
            rec["peft"].append(loss.item())
        eng.export_peft(tmp / "adapter", base_model=str(tmp / "hf"))
        probe = rng.integers(0, SHAPE["vocab_size"], (rows, args.seqlen + 1))
        rec["ours_eval_loss"] = eng.eval_step(probe)
        rec["device"] = getattr(eng.be, "device_name", eng.be.name)
    rec["train_seconds"] = time.perf_counter() - t0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf",
                                                               torch_dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(loaded, tmp / "adapter").to(dev).eval()
    with torch.no_grad():
        pt = torch.as_tensor(probe).to(dev)
        a = loaded(pt).logits.float()
        b = pm.eval()(pt).logits.float()
        rec["export_eval_loss"] = loaded(pt, labels=pt).loss.item()
    rec["logits_rel_diff_export_vs_peft_trained"] = float((a - b).norm() / b.norm())
    rec["export_eval_loss_rel_diff_vs_ours"] = abs(rec["export_eval_loss"] -
                                                   rec["ours_eval_loss"]) / rec["ours_eval_loss"]
    rec["loss_rel_diff"] = [abs(x - y) / y for x, y in zip(rec["ours"], rec["peft"])]
    rec["step1_loss_rel_diff"] = rec["loss_rel_diff"][0]
    return rec


def _step1_grads(eng, mods) -> dict:
    """Max relative error of our step-1 adapter gradients against peft's, for A and B."""
    ours = eng.lora_state()
    worst = {"a": 0.0, "b": 0.0}
    zero_a = True
    for (i, t), m in mods.items():
        for part, prm in (("a", m.lora_A["default"].weight), ("b", m.lora_B["default"].weight)):
            theirs = prm.grad.detach().float().cpu().numpy()
            err = _max_rel(ours[f"layers.{i}.{t}.{part}.grad"], theirs)
            if err is None:
                continue
            zero_a = zero_a and part != "a"
            worst[part] = max(worst[part], err)
    return {"step1_grad_max_rel_err_A": None if zero_a else worst["a"],
            "step1_grad_max_rel_err_B": worst["b"],
            "step1_grad_A_all_zero": zero_a}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.lora_vs_peft")
    p.add_argument("--families", default="llama,qwen3",
                   help="comma-separated, from bench.family_check's dense families")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--b-std", type=float, default=0.0,
                   help="start B from normal(0, S) on both sides (default 0: PEFT's init)")
    p.add_argument("--backend", default="cupy")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        import peft
        import torch
        import transformers
    except ImportError as exc:
        print(f"lora_vs_peft needs torch, transformers and peft: {exc}", file=sys.stderr)
        return 2
    out = {"bench": "lora_vs_peft", "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__,
           "host": platform.node(), "records": []}
    for family in args.families.split(","):
        out["records"].append(run_family(family.strip(), args, torch))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
