"""Logging every step of the engine to TensorBoard, or to a JSON Lines file, through
StepResult.to_dict(): the hook any experiment tracker needs (the comment in `log_step` shows
where Weights & Biases would go). Neither TensorBoard nor W&B is a dependency of dataflow:
TensorBoard is used when `torch.utils.tensorboard` or `tensorboardX` imports, JSON Lines
otherwise (or with --logger jsonl).

    python examples/log_metrics.py --steps 10 --out runs/logged
    tensorboard --logdir runs/logged            # when it wrote TensorBoard events

Each step's batch is handed to the engine one round of sequences at a time (an iterator of
pieces), as a loader that never holds the whole global batch in one array would. Runs on the
NumPy backend (tiny model) without a GPU."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dataflow.data import token_stream
from dataflow.engine import Engine


def flat_scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a to_dict() record, nested keys joined by '/' ('breakdown/wall_s'), lists
    by index; strings and None left out (TensorBoard's add_scalar takes numbers only)."""
    out: dict[str, float] = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            out.update(flat_scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class JsonlLogger:
    """One JSON object per line: the step's to_dict(), as written."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "steps.jsonl"
        self._file = self.path.open("a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()  # a crashed run keeps every finished step

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """Every number of the step's to_dict() as a scalar at its step."""

    def __init__(self, writer_class, out: Path):
        self.path = out
        self._writer = writer_class(log_dir=str(out))

    def log(self, record: dict) -> None:
        for name, value in flat_scalars(record).items():
            if math.isfinite(value):
                self._writer.add_scalar(name, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


def open_logger(kind: str, out: Path):
    """TensorBoard when asked, or for 'auto' when it imports; JSON Lines otherwise."""
    if kind in ("auto", "tensorboard"):
        for module in ("torch.utils.tensorboard", "tensorboardX"):
            try:
                writer = __import__(module, fromlist=["SummaryWriter"]).SummaryWriter
            except ImportError:
                continue
            return TensorBoardLogger(writer, out)
        if kind == "tensorboard":
            raise SystemExit("--logger tensorboard needs torch (pip install torch tensorboard) "
                             "or tensorboardX (pip install tensorboardX); or pass --logger jsonl")
    return JsonlLogger(out)


def rounds_of(eng, start: int):
    """The step's batch as an iterator of pieces, one round's sequences each."""
    ch = eng.plan.chunking
    for r in range(ch.rounds_per_step):
        yield token_stream(ch.seqlen, ch.seqs_per_round, eng.plan.model.vocab_size,
                           start=start + r * ch.seqs_per_round * ch.seqlen)


def log_step(logger, result) -> dict:
    record = result.to_dict()  # plain JSON types; breakdown nested (or None without trace=True)
    logger.log(record)
    # With Weights & Biases (wandb.init(project=...) once before the loop):
    #     wandb.log(record, step=record["step"])
    return record


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("runs/logged"))
    p.add_argument("--logger", choices=("auto", "tensorboard", "jsonl"), default="auto")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--trace", action="store_true",
                   help="also log where each step's time went (the breakdown)")
    args = p.parse_args(argv)

    logger = open_logger(args.logger, args.out)
    records = []
    try:
        with Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend=args.backend,
                    lr=1e-3, seqs_per_step=16, trace=args.trace) as eng:
            start = 0
            for _ in range(args.steps):
                result = eng.train_step(rounds_of(eng, start))
                start += eng.seqs_per_step * 64
                records.append(log_step(logger, result))
                print(f"step {result.step}: loss {result.loss:.4f}, {result.tok_per_s:.0f} "
                      "tok/s", file=sys.stderr)
    finally:
        logger.close()
    print(f"logged {len(records)} steps to {logger.path}", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
