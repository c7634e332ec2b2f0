"""A training loop fed by a PyTorch DataLoader, the engine as its executor: the loader packs
documents into rows (transformers' packing: position_ids that restart at 0 per document, labels
with -100 at each document's first token), and its torch tensors go to train_step as they are,
through DLPack (no copy on the CPU). PyTorch is optional for the engine; this example needs it
(`pip install torch`) and tells you so without it.

    python examples/torch_dataloader.py --steps 10

Runs on the NumPy backend (tiny model) without a GPU."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dataflow.data import shipped_tokens
from dataflow.engine import Engine

IGNORE = -100


def packed_dataset(torch, seqlen: int, n_rows: int, seed: int = 0):
    """A torch Dataset of packed rows: each item is a dict of int64 tensors input_ids,
    position_ids and labels of length seqlen + 1, holding documents of 16..seqlen/2 tokens cut
    from the shipped text."""
    text = shipped_tokens()

    class Packed(torch.utils.data.Dataset):
        def __len__(self):
            return n_rows

        def __getitem__(self, i):
            rng = np.random.default_rng(seed + i)
            ids, pos, labels = [], [], []
            while len(ids) < seqlen + 1:
                n = int(rng.integers(16, seqlen // 2))
                at = int(rng.integers(0, text.size - n))
                doc = text[at:at + n].tolist()
                ids += doc
                pos += list(range(n))
                labels += [IGNORE] + doc[1:]      # a document's first token predicts nothing
            cut = slice(0, seqlen + 1)
            return {"input_ids": torch.tensor(ids[cut]), "position_ids": torch.tensor(pos[cut]),
                    "labels": torch.tensor(labels[cut])}

    return Packed()


def main(argv: list[str] | None = None) -> list[tuple[int, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("this example needs PyTorch for its DataLoader: pip install torch", file=sys.stderr)
        raise SystemExit(2)

    loader = torch.utils.data.DataLoader(packed_dataset(torch, args.seqlen,
                                                        args.batch * args.steps),
                                         batch_size=args.batch, shuffle=False, num_workers=0)
    losses = []
    with Engine(args.model, host_gb=1, dev_gb=0.25, seqlen=args.seqlen, backend=args.backend,
                seqs_per_step=args.batch, lr=args.lr, max_grad_norm=1.0) as eng:
        for step, batch in enumerate(loader, start=1):
            r = eng.train_step(batch["input_ids"], batch["labels"],
                               position_ids=batch["position_ids"])
            losses.append((step, r.loss))
            print(f"step {step}: loss {r.loss:.4f} over {r.loss_tokens} tokens", file=sys.stderr)
    return losses


if __name__ == "__main__":
    main()
