"""`dataflow-ring --gpus N <host_gb> <dev_gb> <seqlen> <model> [--replicas R] [--steps S] ...`:
train R data-parallel rings of N / R ranks (layer i on rank i mod N/R). Without RANK/WORLD_SIZE
(or SLURM_PROCID/SLURM_NTASKS) in the environment it spawns the N processes itself; under
torchrun or srun this process is one of them.
Exit 0 done, 2 with one line for bad input, 1 with one line per failed rank when the ring failed.
Argument parsing and main only (a leaf: no ring module imports it); the layout is chosen by
dataflow.ring.layout, the job run by dataflow.ring.run. Never trains in the launching process."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import dataflow
from dataflow.cli.args import (OneLineParser, check_checkpoint_flags, parse_or_exit_code,
                               positive)
from dataflow.cli.data import add_tokenise_flags
from dataflow.data.tokenizer import BYTES, own_tokenizer_file
from dataflow.memplan.search.cost import MAX_ROUNDS_PER_STEP
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import MODEL_FORMS
from dataflow.precision import PRECISIONS
from dataflow.ring.job import RingJob, model_config
from dataflow.ring.kinds import PLACEMENT_CHOICES, TransportKind
from dataflow.ring.layout import AUTO_OVERLAP, resolve_layout
from dataflow.ring.run import ring_processes, run_job

PROG = "dataflow-ring"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=(
        "Train MODEL on a ring of N ranks: layer i lives on rank i mod N, the embedding on rank "
        "0, the head on the rank of the last layer; residuals go to the next rank, gradients to "
        "the previous. Budgets are per device; GB means GiB (2^30 bytes). Spawns the ranks, or "
        "runs as one rank under torchrun/srun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
        "MASTER_PORT; SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)."))
    p.add_argument("host_gb", type=positive(float), help="pinned host memory per rank, GiB")
    p.add_argument("dev_gb", type=positive(float), help="device memory per rank, GiB")
    p.add_argument("seqlen", type=positive(int), help="tokens per sequence")
    p.add_argument("model", help=f"{MODEL_FORMS}; the ring trains the model's shape from "
                                 "--seed's initialisation (it loads no weights yet)")
    p.add_argument("--gpus", type=positive(int), default=None, metavar="N",
                   help="processes in all (required unless launched by torchrun/srun)")
    p.add_argument("--replicas", type=positive(int), default=None, metavar="R",
                   help="data-parallel copies of the ring: rings of N / R ranks, each training "
                        "1/R of the global batch, gradients all-reduced once per step before "
                        "the optimizer (default: the planner's choice, the split of N that "
                        "predicts the most tok/s; it prints the alternatives it weighed)")
    p.add_argument("--placement", choices=PLACEMENT_CHOICES, default="cyclic",
                   help="how a ring deals its layers: cyclic (layer i on rank i mod N, the "
                        "default), balanced (a walk around the ring in which the head's rank "
                        "owns fewer layers, by the head's cost in layers), contiguous (the same "
                        "counts in one block per rank), auto (the planner's prediction decides)")
    p.add_argument("--tokens-per-step", type=positive(int), default=None, metavar="T",
                   help="cap on the global batch in tokens (a multiple of seqlen per replica); "
                        "the layout is chosen under it")
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="every rank of a ring of 2+ computes the logits and loss over 1/N of "
                        "the vocabulary, instead of the last layer's rank carrying the whole "
                        "head (untied dense models; no checkpoints yet; over NCCL checked for "
                        "deadlocks first, not yet run on two GPUs; docs/ring.md)")
    ovl = p.add_mutually_exclusive_group()
    ovl.add_argument("--no-round-overlap", action="store_true",
                     help="run a step's rounds in turn (the default, the same as leaving both "
                          "flags out)")
    ovl.add_argument("--round-overlap", type=positive(int), nargs="?", const=AUTO_OVERLAP,
                     default=None, metavar="D",
                     help="overlapped rounds (issue 56): each rank runs the next round's forward "
                          "of its first D local layers where it would wait during a round's "
                          "drain, its budget less the second round's rows and activations; the "
                          "same losses and weights bit for bit. D given: that depth; no D: the "
                          "planner weighs depths 1, 2, 4, 8 and keeps the fastest predicted "
                          "(perhaps none; rounds in turn where its ranks are ones this does "
                          "not run, said on stderr). Shared-memory transport (CuPy: not yet run on "
                          "a GPU), ranks whose layers stay on the device, dense models")
    p.add_argument("--steps", type=positive(int), default=3)
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, metavar="X",
                   help="clip the global gradient norm to X (default 1.0, as dataflow-demo and "
                        "the Engine; 0 turns clipping off)")
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                   help="numpy (shared-memory transport) or cupy (NCCL, one GPU per rank)")
    p.add_argument("--transport", choices=tuple(k.value for k in TransportKind), default="auto",
                   help="auto: NCCL with cupy, shared memory with numpy; shm with cupy lets "
                        "several ranks share GPUs (device bytes staged through pinned memory)")
    p.add_argument("--timeout", type=positive(float), default=120.0, metavar="S",
                   help="seconds a rank waits for a neighbour before giving up (default 120)")
    p.add_argument("--out", metavar="DIR", default="",
                   help="write each rank's losses (rank<r>.json) and weights (rank<r>.npz)")
    p.add_argument("--rounds", type=positive(int), default=None, metavar="N",
                   help="rounds per step on every rank (default: the planner's choice); the "
                        "global batch is N rounds of the chunks per round")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="the linear layers' arithmetic: bf16 (default) or fp8, their GEMMs in "
                        "the FP8 recipe of docs/fp8.md (E4M3 forward, E5M2 gradients, "
                        "per-tensor scales) on every rank, on an sm_89+ GPU or the numpy "
                        "backend")
    p.add_argument("--eager-update", action="store_true",
                   help="run each step's AdamW after its last round (default: deferred into the "
                        "next step's first round, behind its compute; the same bits either way)")
    p.add_argument("--no-weights", action="store_true",
                   help="with --out, leave out rank<r>.npz (a large model's weights are tens of "
                        "GB per rank)")
    p.add_argument("--eval-seqs", type=positive(int), default=0, metavar="N",
                   help="after the last step, the forward-only loss of the N sequences that "
                        "follow the run's training data (RingEngine.eval_step's evaluation)")
    p.add_argument("--checkpoint-dir", metavar="D", default="",
                   help="directory of checkpoints (step_NNNNNNNN/), one that every rank sees; "
                        "the Engine's format, so one device or a ring of another size resumes "
                        "from them")
    p.add_argument("--force-checkpoint-dir", action="store_true",
                   help="write checkpoints into --checkpoint-dir even though it holds other "
                        "files (a model directory, say); without it such a directory is refused")
    p.add_argument("--save-every", type=positive(int), default=0, metavar="N",
                   help="save a checkpoint every N steps and at the last step")
    p.add_argument("--keep", type=int, default=3, metavar="K",
                   help="keep the newest K checkpoints (default 3; 0 keeps all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (from step 0 "
                        "when there is none); --steps is then the run's total")
    p.add_argument("--split-fetch", action="store_true",
                   help="with replicas: each fetches 1/R of every streamed weight from its host "
                        "memory and the replicas gather the rest from each other (default: each "
                        "fetches everything; measured no faster on 2 H200s, docs/ring.md)")
    p.add_argument("--split-update", action="store_true",
                   help="with R >= 2 replicas (rings of any size; shared memory, or NCCL not yet "
                        "run on two GPUs): reduce-scatter each block's gradient among the "
                        "replicas' ranks that hold it, each runs AdamW on its 1/R part "
                        "alone (every rank planned with AdamW state for that part "
                        "only, so layouts that fit only so are weighed and launch) and the "
                        "updated parts are gathered; the same bits as without (NCCL: with 2 "
                        "replicas); off by default; no checkpoints; docs/ring.md \"Split updates\"")
    p.add_argument("--trace", action="store_true",
                   help="every rank times its backend's streams (dataflow.instrument) and prints "
                        "each step's breakdown (compute, exposed copy, host, idle: waiting on a "
                        "neighbour or the all-reduce); with --out also into rank<r>.json. Adds "
                        "a CUDA event pair per launch")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (losses, per-rank exit codes) to stdout")
    p.add_argument("--data", metavar="PATH",
                   help="train on this instead of the shipped text, read as dataflow-demo "
                        "reads it (text, JSONL, chat, Parquet/Arrow tokenised once with the "
                        "model's own tokenizer; token files as they are); every rank reads the "
                        "same global batches")
    add_tokenise_flags(p)
    p.add_argument("--debug", action="store_true", help="tracebacks from failing ranks")
    p.add_argument("--version", action="version", version=f"%(prog)s {dataflow.__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, code = parse_or_exit_code(build_parser(), argv, PROG)
    if args is None:
        return code
    try:
        requested = TransportKind(args.transport)  # argparse's choices: always one of them
        if args.backend == "numpy" and requested is TransportKind.NCCL:
            raise ConfigError("the NCCL transport needs --backend cupy")
        if args.rounds is not None and args.rounds > MAX_ROUNDS_PER_STEP:
            raise ConfigError(f"--rounds {args.rounds} exceeds the planner's "
                              f"{MAX_ROUNDS_PER_STEP}; give fewer (the global batch is rounds x "
                              "chunks per round)")
        check_checkpoint_flags(args.checkpoint_dir, args.save_every, args.keep, args.resume,
                               args.force_checkpoint_dir)
        if args.vocab_parallel_head and args.checkpoint_dir:
            raise ConfigError("--vocab-parallel-head runs without --checkpoint-dir so far (the "
                              "checkpoint format keeps the head block whole); drop one of them")
        if args.split_update and args.checkpoint_dir:
            raise ConfigError("--split-update runs without --checkpoint-dir so far (a replica "
                              "holds AdamW state for its part only); drop one of them")
        data, data_options = _job_data(args)
        env, gpus = ring_processes(args.model, args.gpus, args.replicas or 1)
        transport = requested.resolve(args.backend)
        if args.round_overlap is not None and transport is not TransportKind.SHM:
            raise ConfigError("--round-overlap runs over the shared-memory transport so far "
                              "(NCCL takes a link's messages in the order sent, and overlapped "
                              "rounds would deadlock on its sends); add --transport shm (ranks "
                              "of one host) or drop the flag")
        replicas, constraints = resolve_layout(
            args.model, args.seqlen, args.host_gb, args.dev_gb, gpus, backend=args.backend,
            transport=transport, replicas=args.replicas, tokens_per_step=args.tokens_per_step,
            rounds=args.rounds, quiet=env is not None and env.rank != 0,
            placement=args.placement, split_fetch=args.split_fetch,
            vocab_parallel=args.vocab_parallel_head, round_overlap=args.round_overlap,
            split_update=args.split_update)
        constraints = dict(constraints)
        placement = constraints.pop("placement", "cyclic")
        vocab_parallel = bool(constraints.pop("vocab_parallel", False))
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.debug:
        os.environ["DATAFLOW_RING_DEBUG"] = "1"
    # Without --out the launcher still reads rank 0's step times, from a folder it removes.
    out = args.out or ("" if env else tempfile.mkdtemp(prefix="dataflow-ring-"))
    job = RingJob(model=args.model, seqlen=args.seqlen, host_gb=args.host_gb, dev_gb=args.dev_gb,
                  gpus=gpus, save_weights=bool(args.out) and not args.no_weights,
                  steps=args.steps, seed=args.seed, lr=args.lr,
                  max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
                  backend=args.backend, replicas=replicas, transport=transport,
                  timeout_s=args.timeout, out_dir=out, eager_update=args.eager_update,
                  precision=args.precision,
                  eval_seqs=args.eval_seqs, trace=args.trace,
                  split_fetch=args.split_fetch, split_update=args.split_update,
                  vocab_parallel_head=vocab_parallel,
                  checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                  keep=args.keep, resume=args.resume,
                  force_checkpoint_dir=args.force_checkpoint_dir,
                  constraints=tuple(sorted(constraints.items())), placement=placement,
                  data=data, data_options=data_options)
    return run_job(job, env, as_json=args.json, prog=PROG, keep_out=bool(args.out))


def _job_data(args) -> tuple[str, tuple]:
    """(RingJob.data, data_options): the shipped text's bytes for a byte model with no --data
    (as the ring always trained), else 'text:' data opened here once (tokenised into its cache
    before any rank starts; a bad file is refused with exit 2)."""
    if args.data is None and (args.tokenizer == BYTES or own_tokenizer_file(args.model) is None):
        return "shipped", ()
    # the data path: only for a ring that reads text
    from dataflow.data.open_data import DataOptions, open_data

    options = DataOptions.from_args(args)
    cfg = model_config(args.model)
    open_data(args.data, args.seqlen, cfg.vocab_size, model=args.model, options=options,
              eval_seqs=args.eval_seqs)
    fields = tuple((k, v) for k, v in dataclasses.asdict(options).items())
    return f"text:{args.data or ''}", fields


if __name__ == "__main__":
    sys.exit(main())
