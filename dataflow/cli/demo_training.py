"""The training-run options of dataflow-demo: lr schedule and clipping (--warmup, --min-lr,
--max-grad-norm), user data and validation (--data, --eval-every), checkpoints and resume
(--checkpoint-dir, --force-checkpoint-dir, --save-every, --keep, --resume). Turns them into
engine arguments and the per-step hooks the demo's loop calls. Never decides placement and
never runs a step itself."""

from __future__ import annotations

import argparse
import logging
import time

from dataflow.cli.args import check_checkpoint_flags, int_at_least
from dataflow.cli.data import add_tokenise_flags
from dataflow.lr_schedule import WarmupCosine
from dataflow.models.errors import ConfigError
from dataflow.optimizer import AdamWConfig

log = logging.getLogger("dataflow.demo")

EVAL_SEQS = 4
"""Held-out sequences per validation unless --eval-seqs says otherwise (a number, not a share of
the plan's batch, so the held-out split never depends on the plan and a run resumes under any
plan)."""
DEFAULT_WARMUP = 10
"""Warmup steps unless --warmup says otherwise (see default_warmup)."""
WIDTH_LR_DIM = 2048
"""Model width up to which the default peak lr is 3e-4; wider models get 3e-4 * this / width."""


def default_warmup(model_dim: int, steps: int) -> int:
    """DEFAULT_WARMUP, cut to a shorter run for models up to 1b's width (they reach the peak lr
    at the run's last step, as nanoGPT-style demos do), but not for wider ones: a run shorter
    than their warmup ends before the peak, since a wide model's first full-lr Adam steps
    overshoot (measured on the H100: 8b's loss rose 11.88 -> 8.02 -> 15.85 when a 3-step run
    reached the peak at step 3; with the full warmup it fell 11.88 -> 8.88 -> 7.58)."""
    return DEFAULT_WARMUP if model_dim > WIDTH_LR_DIM else min(DEFAULT_WARMUP, steps)


def default_lr(model_dim: int) -> float:
    """Peak lr when --lr is not given: 1e-3 for the toy models (width <= 256), 3e-4 up to width
    2048 (1b), and 3e-4 * 2048 / width above (8b: 1.5e-4). Adam moves every weight by about lr
    per step whatever its gradient's size, so a layer's output moves about width * lr: wider
    models need proportionally smaller steps (Llama 3 trained 8B at 3e-4 but warmed up for
    8,000 steps; a demo warms up for 10)."""
    if model_dim <= 256:
        return 1e-3
    return 3e-4 * min(1.0, WIDTH_LR_DIM / model_dim)


_count = int_at_least(0, not_int="'{text}' is not an integer", too_small="{text} must be >= 0")
_interval = int_at_least(1, not_int="'{text}' is not a whole number of steps",
                         too_small="{text} must be at least 1 (every N steps); leave "
                                   "--eval-every out to run no validation")
"""Every N steps, N >= 1: 0 would mean never, which leaving the flag out already says."""
_positive = int_at_least(1)


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "training run", "The lr follows a linear warmup then a cosine decay to --min-lr at "
        "--steps. With --resume, --steps is the run's total: a run resumed at step 3 with "
        "--steps 6 trains 3 more steps.")
    g.add_argument("--warmup", type=_count, default=None, metavar="N",
                   help=f"warmup steps (default {DEFAULT_WARMUP}, cut to --steps for models "
                        "up to 1b's width; a run shorter than its warmup ends before the peak "
                        "lr)")
    g.add_argument("--min-lr", type=_nonneg_float, default=None, metavar="X",
                   help="lr at the end of the cosine decay (default --lr / 10)")
    g.add_argument("--max-grad-norm", type=_nonneg_float, default=1.0, metavar="X",
                   help="clip the global gradient norm to X (default 1.0; 0 turns clipping "
                        "off); the norm is reported every step either way")
    g.add_argument("--data", metavar="PATH",
                   help="train on this instead of the shipped text: text files or a folder "
                        "of them, JSONL (a 'text' field or chat 'messages'), Parquet/Arrow "
                        "text, all tokenised with the model's own tokenizer (see "
                        "'tokenising'); or token ids as they are: .npy, .bin (raw uint16 as "
                        "nanoGPT writes, *.u32.bin raw uint32, or llm.c's header format), "
                        "Parquet with a 'tokens' column")
    g.add_argument("--eval-every", type=_interval, default=None, metavar="N",
                   help="every N >= 1 steps, the validation loss on --eval-seqs held-out "
                        "sequences (the end of the data, never trained on; the last file for "
                        "Parquet), forward only on the engine (Engine.eval_step); default: no "
                        "validation")
    g.add_argument("--eval-seqs", type=_positive, default=EVAL_SEQS, metavar="N",
                   help=f"held-out sequences per validation (default {EVAL_SEQS}; more gives "
                        "a steadier loss; a resumed run must pass the number it started with)")
    g.add_argument("--checkpoint-dir", metavar="D",
                   help="directory of checkpoints (step_NNNNNNNN/ subdirectories); one that "
                        "holds anything else (a model, other files) is refused")
    g.add_argument("--force-checkpoint-dir", action="store_true",
                   help="write checkpoints into --checkpoint-dir even though it holds other "
                        "files (a model directory, say)")
    g.add_argument("--save-every", type=_count, default=0, metavar="N",
                   help="save a checkpoint every N steps and at the last step")
    g.add_argument("--keep", type=_count, default=3, metavar="K",
                   help="keep the newest K checkpoints (default 3; 0 keeps all)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (start "
                        "fresh when there is none): weights, AdamW state, step, schedule, "
                        "data position")
    add_tokenise_flags(p)


def check_flags(args) -> None:
    """Refuse combinations argparse cannot see (raised as ConfigError: exit 2)."""
    check_checkpoint_flags(args.checkpoint_dir or "", args.save_every, args.keep, args.resume,
                           args.force_checkpoint_dir)


class Training:
    """Schedule, optimizer settings, data and checkpoints of one demo run."""

    def __init__(self, args, cfg, lr: float):
        check_flags(args)
        self.args, self.cfg = args, cfg
        warmup = default_warmup(cfg.model_dim, args.steps) if args.warmup is None \
            else args.warmup
        min_lr = lr / 10 if args.min_lr is None else args.min_lr
        if min_lr > lr:
            raise ConfigError(f"--min-lr {min_lr:g} is above --lr {lr:g}; pass a smaller "
                              f"--min-lr (default lr / 10 = {lr / 10:g})")
        self.schedule = WarmupCosine(lr=lr, total_steps=max(args.steps, warmup),
                                     warmup_steps=warmup, min_lr=min_lr)
        self.optimizer = AdamWConfig(lr=lr, max_grad_norm=args.max_grad_norm or None)
        self.source = None
        self.eval_losses: list[tuple[int, float]] = []

    def open_data(self, seqlen: int) -> None:
        """Open --data (or the shipped text) now, before the engine is built, so a bad file is
        refused (ConfigError: exit 2, naming it) before anything is initialised or written."""
        # NumPy and the tokeniser: loaded only for a run, not --help
        from dataflow.data.open_data import DataOptions, open_data

        self.source = open_data(self.args.data, seqlen, self.cfg.vocab_size,
                                model=self.args.model, options=DataOptions.from_args(self.args),
                                eval_seqs=self.args.eval_seqs if self.args.eval_every else 0)

    def start(self, eng) -> None:
        """Open the data (unless open_data did), then resume weights, state and data position
        if asked."""
        # NumPy and numba: only for a run
        from dataflow.checkpoint import ModelMismatchError, latest_checkpoint

        args = self.args
        if self.source is None:
            self.open_data(eng.plan.chunking.seqlen)
        if not args.resume:
            return
        path = latest_checkpoint(args.checkpoint_dir)
        if path is None:
            log.info("no checkpoint in %s yet: starting at step 0", args.checkpoint_dir)
            return
        try:
            info = eng.load_checkpoint(path)
        except ModelMismatchError as exc:
            raise ConfigError(
                f"--resume: checkpoint {path} was made from model '{exc.checkpoint_model.name}', "
                f"this run trains '{exc.engine_model.name}' "
                f"({'; '.join(exc.differences[:4])}); pass the model it was made from "
                f"({exc.checkpoint_model.name}, or the checkpoint {path} itself), or another "
                "--checkpoint-dir for this model") from None
        except ConfigError as exc:
            raise ConfigError(f"{exc} (for the demo: pass the --lr, --warmup, --min-lr, "
                              "--max-grad-norm and --steps of the saved run)") from None
        if info.data is not None:
            self.source.load_state(info.data)
        log.info("resumed from %s at step %d (lr %.3g next)", path, info.step,
                 self.schedule(info.step + 1))

    def remaining(self, eng) -> int:
        """Steps left until --steps (0 when a resumed run is already there)."""
        return max(0, self.args.steps - eng.optimizer.step_count)

    def next_batch(self, eng):
        """(args, kwargs) of the next Engine.train_step."""
        return step_args(self.source.next_batch(eng.seqs_per_step))

    def after_step(self, eng, result) -> None:
        """Validation and checkpoint after step `result.step`, when their interval says so."""
        args, step = self.args, result.step
        if args.eval_every and step % args.eval_every == 0:
            held, kwargs = step_args(self.source.eval_batch(args.eval_seqs))
            loss = eng.eval_step(*held, **kwargs)
            self.eval_losses.append((step, loss))
            log.info("step %d: validation loss %.4f (%d held-out sequences)", step, loss,
                     args.eval_seqs)
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            t0 = time.perf_counter()
            path = eng.save_checkpoint(args.checkpoint_dir, data=self.source.state(),
                                       extra={"demo_args": _jsonable(args)},
                                       keep=args.keep or None,
                                       force_dir=args.force_checkpoint_dir)
            log.info("step %d: checkpoint %s (%.1f s)", step, path, time.perf_counter() - t0)


def _jsonable(args) -> dict:
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, type(None)))}


def step_args(batch) -> tuple[tuple, dict]:
    """A source's batch (token rows, or a TokenBatch with labels and doc_ids) as the
    (args, kwargs) of Engine.train_step / eval_step."""
    if hasattr(batch, "step_args"):
        return batch.step_args()
    return (batch,), {}
