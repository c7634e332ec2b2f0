"""Our loss against transformers' LlamaForCausalLM on the same weights and the same batch, for
the trainer-facing features: labels masked with -100, and packed documents given by position
ids that restart (transformers treats restarting position_ids as separate documents only with
flash-attention varlen, so each packed row is also compared with its documents run separately).
Run on a machine with torch and transformers (never a dependency of the project):

    python bench/archive/transformers_check.py [--backend cupy] [--model small]

Prints one JSON document: the losses and their relative differences."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/archive/transformers_check.py")
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", default="small")
    p.add_argument("--seqlen", type=int, default=256)
    args = p.parse_args(argv)
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as exc:
        print(f"transformers_check needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    from dataflow.engine import Engine

    rng = np.random.default_rng(0)
    with Engine(args.model, host_gb=4, dev_gb=2, seqlen=args.seqlen, backend=args.backend,
                seed=1) as eng:
        cfg, rows = eng.plan.model, eng.seqs_per_step
        tokens = rng.integers(0, cfg.vocab_size, (rows, args.seqlen + 1))
        labels = tokens.copy()
        labels[:, : args.seqlen // 4] = -100                # a masked "prompt" in every row
        cut = args.seqlen // 2                                # two documents per row
        pos = np.concatenate([np.arange(cut), np.arange(args.seqlen + 1 - cut)])[None].repeat(
            rows, 0)
        ours_masked = eng.eval_step(tokens, labels)
        ours_packed = eng.eval_step(tokens, position_ids=pos)
        tmp = tempfile.mkdtemp()
        eng.save_pretrained(tmp)
    model = LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).cuda().eval()
    t = torch.as_tensor(tokens).cuda()
    with torch.no_grad():
        # transformers shifts labels inside; given all seqlen + 1 tokens its targets are
        # labels[:, 1:], ours too (the last token's logits are computed and unused).
        theirs_masked = model(t, labels=torch.as_tensor(labels).cuda()).loss.item()
        # Packed: each document alone (no cross-document attention, positions from 0); the
        # mean over the predicted targets (a document's last token predicts nothing).
        total, count = 0.0, 0
        for a, b in ((0, cut), (cut, args.seqlen + 1)):
            doc = torch.as_tensor(tokens[:, a:b]).cuda()
            logits = model(doc[:, :-1]).logits.float()
            lp = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), doc[:, 1:].reshape(-1), reduction="sum")
            total, count = total + lp.item(), count + doc[:, 1:].numel()
        theirs_packed = total / count
    out = {"model": args.model, "seqlen": args.seqlen, "rows": int(rows),
           "ours_masked": ours_masked, "transformers_masked": theirs_masked,
           "masked_rel_diff": abs(ours_masked - theirs_masked) / theirs_masked,
           "ours_packed": ours_packed, "transformers_packed_separately": theirs_packed,
           "packed_rel_diff": abs(ours_packed - theirs_packed) / theirs_packed}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
