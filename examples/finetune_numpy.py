"""Fine-tuning loop with the engine as its executor: plain NumPy batches built from an Arrow table,
prompts masked out of the loss with -100 (transformers' convention), the trainer's own global
batch and learning-rate schedule, a held-out evaluation every N steps and checkpoints.

The data are prompt -> reply pairs cut from the text shipped with the package (one sentence,
then the next), byte-level tokens; a real run would read its own tokenised Parquet instead.

    python examples/finetune_numpy.py --steps 20 --eval-every 5 --out runs/finetune

Runs on the NumPy backend (tiny model) without a GPU; pass --backend cupy --model 1b on one."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataflow.data import encode, shipped_text
from dataflow.engine import Engine

IGNORE = -100
"""Labels equal to this count in no loss and no gradient (transformers' ignore index)."""


def pairs_table() -> pa.Table:
    """Arrow table of (prompt, reply) token lists: consecutive sentences of the shipped text."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", shipped_text())
                 if 20 < len(s) < 200]
    prompts = [encode(s + "\n").tolist() for s in sentences[:-1]]
    replies = [encode(s + "\n").tolist() for s in sentences[1:]]
    return pa.table({"prompt": prompts, "reply": replies})


def make_batch(table: pa.Table, rows: np.ndarray, seqlen: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels), each (len(rows), seqlen + 1): prompt then reply, right-padded with 0;
    labels are the tokens with the prompt and the padding set to -100."""
    prompt, reply = table.column("prompt"), table.column("reply")
    tokens = np.zeros((len(rows), seqlen + 1), np.int64)
    labels = np.full_like(tokens, IGNORE)
    for i, r in enumerate(rows):
        p = np.asarray(prompt[int(r)].as_py())[:seqlen // 2]
        a = np.asarray(reply[int(r)].as_py())[:seqlen + 1 - p.size]
        tokens[i, :p.size], tokens[i, p.size:p.size + a.size] = p, a
        labels[i, p.size:p.size + a.size] = a          # learn the reply only
    return tokens, labels


def lr_at(step: int, *, peak: float, warmup: int, total: int) -> float:
    """The trainer's own schedule: linear warmup, then cosine to a tenth of the peak."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--host-gb", type=float, default=1.0)
    ap.add_argument("--dev-gb", type=float, default=0.25)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", default="runs/finetune", help="checkpoint directory")
    args = ap.parse_args(argv)

    table = pairs_table()
    rng = np.random.default_rng(0)
    order = rng.permutation(table.num_rows)
    held_out, train = order[:args.batch], order[args.batch:]
    history = {"train": [], "eval": [], "checkpoints": []}
    with Engine(args.model, host_gb=args.host_gb, dev_gb=args.dev_gb, seqlen=args.seqlen,
                backend=args.backend, seqs_per_step=args.batch, max_grad_norm=1.0) as eng:
        eval_tokens, eval_labels = make_batch(table, held_out, args.seqlen)
        history["eval"].append((0, eng.eval_step(eval_tokens, eval_labels)))
        for step in range(1, args.steps + 1):
            rows = train[(step - 1) * args.batch % len(train):][:args.batch]
            if len(rows) < args.batch:
                rows = train[:args.batch]
            tokens, labels = make_batch(table, rows, args.seqlen)
            lr = lr_at(step, peak=args.lr, warmup=max(1, args.steps // 10), total=args.steps)
            r = eng.train_step(tokens, labels, lr=lr)
            history["train"].append((step, r.loss, r.loss_tokens, r.grad_norm, r.lr))
            print(f"step {step}: loss {r.loss:.4f} over {r.loss_tokens} reply tokens, "
                  f"grad norm {r.grad_norm:.3f}, lr {r.lr:.2e}, {r.step_time_s:.2f} s",
                  file=sys.stderr)
            if step % args.eval_every == 0 or step == args.steps:
                loss = eng.eval_step(eval_tokens, eval_labels)
                history["eval"].append((step, loss))
                path = eng.save_checkpoint(Path(args.out), data={"step": step}, keep=2)
                history["checkpoints"].append(str(path))
                print(f"step {step}: held-out loss {loss:.4f}; saved {path}", file=sys.stderr)
    return history


if __name__ == "__main__":
    main()
