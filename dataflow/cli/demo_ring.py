"""`dataflow-demo <host_gb> <dev_gb> <seqlen> <model> --gpus N`: the demo on N GPUs in the layout
the planner chooses (replicas of a ring, dataflow.memplan.search.layout; budgets per device; --rounds or
--tokens-per-step shape the global batch) through dataflow.ring.run's launcher: it spawns the ranks
(or, under torchrun / srun with --gpus equal to WORLD_SIZE, is one of them), prints each rank's
step lines and one summary line (tok/s of the whole ring). Constant lr, clipping as
--max-grad-norm, the shipped text; --checkpoint-dir, --save-every, --keep and --resume as on one
GPU (the same checkpoint format). Never decides placement and never trains in the launching
process."""

from __future__ import annotations

import tempfile

from dataflow.cli.args import check_checkpoint_flags
from dataflow.models.errors import ConfigError
from dataflow.ring.job import RingJob
from dataflow.ring.kinds import TransportKind
from dataflow.ring.layout import launch_backend, resolve_layout
from dataflow.ring.run import ring_processes, run_job

NOT_FOR_A_RING = {"plan": "--plan", "trace": "--trace", "metrics": "--metrics",
                  "seqs_per_step": "--seqs-per-step", "warmup": "--warmup",
                  "min_lr": "--min-lr", "data": "--data", "eval_every": "--eval-every",
                  "eval_seqs": "--eval-seqs"}
"""Demo options a ring does not take yet (dest -> flag)."""


def run_ring(args, parser, lr: float) -> int:
    """Train args' model on a ring of args.gpus ranks; the process's exit code."""
    used = [flag for dest, flag in NOT_FOR_A_RING.items()
            if getattr(args, dest, None) != parser.get_default(dest)]
    if used:
        raise ConfigError(f"--gpus {args.gpus} trains a ring, which does not take "
                          f"{', '.join(used)} yet; drop them, or train on one GPU")
    check_checkpoint_flags(args.checkpoint_dir or "", args.save_every, args.keep, args.resume,
                           args.force_checkpoint_dir)
    env, n = ring_processes(args.model, args.gpus, 1)
    backend = launch_backend(args.backend)
    replicas, constraints = resolve_layout(
        args.model, args.seqlen, args.host_gb, args.dev_gb, n, backend=backend,
        transport=TransportKind.AUTO.resolve(backend), replicas=None,
        tokens_per_step=args.tokens_per_step, rounds=args.rounds,
        quiet=env is not None and env.rank != 0)
    job = RingJob(gpus=n, replicas=replicas, constraints=constraints, model=args.model,
                  seqlen=args.seqlen, host_gb=args.host_gb,
                  dev_gb=args.dev_gb, steps=args.steps, seed=args.seed, lr=lr,
                  max_grad_norm=args.max_grad_norm or None, backend=backend,
                  transport=TransportKind.AUTO, timeout_s=300.0, save_weights=False,
                  eager_update=args.eager_update, precision=args.precision or "bf16",
                  checkpoint_dir=args.checkpoint_dir or "",
                  save_every=args.save_every, keep=args.keep, resume=args.resume,
                  force_checkpoint_dir=args.force_checkpoint_dir,
                  out_dir="" if env else tempfile.mkdtemp(prefix="dataflow-demo-ring-"))
    return run_job(job, env, as_json=args.json, prog="dataflow-demo", keep_out=False)

