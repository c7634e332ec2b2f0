"""`dataflow-ring --gpus N <host_gb> <dev_gb> <seqlen> <model> [--replicas R] [--steps S] ...`:
train R data-parallel rings of N / R ranks (layer i on rank i mod N/R). Without RANK/WORLD_SIZE
(or SLURM_PROCID/SLURM_NTASKS) in the environment it spawns the N processes itself; under
torchrun or srun this process is one of them.
Exit 0 done, 2 with one line for bad input, 1 with one line per failed rank when the ring failed.
Never trains in the launching process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from dataflow.memplan.cli_args import (OneLineParser, check_checkpoint_flags, parse_or_exit_code,
                               positive)
from dataflow.models.errors import ConfigError

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
    p.add_argument("model", help="zoo name (tiny, small, 1b, 8b, ...) or a config path")
    p.add_argument("--gpus", type=positive(int), default=None, metavar="N",
                   help="processes in all (required unless launched by torchrun/srun)")
    p.add_argument("--replicas", type=positive(int), default=None, metavar="R",
                   help="data-parallel copies of the ring: rings of N / R ranks, each training "
                        "1/R of the global batch, gradients all-reduced once per step before "
                        "the optimizer (default: the planner's choice, the split of N that "
                        "predicts the most tok/s; it prints the alternatives it weighed)")
    p.add_argument("--placement", choices=("cyclic", "balanced", "contiguous", "auto"),
                   default="cyclic",
                   help="how a ring deals its layers: cyclic (layer i on rank i mod N, the "
                        "default), balanced (a walk around the ring in which the head's rank "
                        "owns fewer layers, by the head's cost in layers), contiguous (the same "
                        "counts in one block per rank), auto (the planner's prediction decides)")
    p.add_argument("--tokens-per-step", type=positive(int), default=None, metavar="T",
                   help="cap on the global batch in tokens (a multiple of seqlen per replica); "
                        "the layout is chosen under it")
    p.add_argument("--steps", type=positive(int), default=3)
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, metavar="X",
                   help="clip the global gradient norm to X (default 1.0, as dataflow-demo and "
                        "the Engine; 0 turns clipping off)")
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                   help="numpy (shared-memory transport) or cupy (NCCL, one GPU per rank)")
    p.add_argument("--transport", choices=("auto", "nccl", "shm"), default="auto",
                   help="auto: NCCL with cupy, shared memory with numpy; shm with cupy lets "
                        "several ranks share GPUs (device bytes staged through pinned memory)")
    p.add_argument("--timeout", type=positive(float), default=120.0, metavar="S",
                   help="seconds a rank waits for a neighbour before giving up (default 120)")
    p.add_argument("--out", metavar="DIR", default="",
                   help="write each rank's losses (rank<r>.json) and weights (rank<r>.npz)")
    p.add_argument("--rounds", type=positive(int), default=None, metavar="N",
                   help="rounds per step on every rank (default: the planner's choice); the "
                        "global batch is N rounds of the chunks per round")
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
    p.add_argument("--trace", action="store_true",
                   help="every rank times its backend's streams (dataflow.instrument) and prints "
                        "each step's breakdown (compute, exposed copy, host, idle: waiting on a "
                        "neighbour or the all-reduce); with --out also into rank<r>.json. Adds "
                        "a CUDA event pair per launch")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (losses, per-rank exit codes) to stdout")
    p.add_argument("--debug", action="store_true", help="tracebacks from failing ranks")
    import dataflow

    p.add_argument("--version", action="version", version=f"%(prog)s {dataflow.__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, code = parse_or_exit_code(build_parser(), argv, PROG)
    if args is None:
        return code
    from dataflow.ring.worker import RingJob

    try:
        if args.backend == "numpy" and args.transport == "nccl":
            raise ConfigError("the NCCL transport needs --backend cupy")
        from dataflow.memplan.search.cost import MAX_ROUNDS_PER_STEP

        if args.rounds is not None and args.rounds > MAX_ROUNDS_PER_STEP:
            raise ConfigError(f"--rounds {args.rounds} exceeds the planner's "
                              f"{MAX_ROUNDS_PER_STEP}; give fewer (the global batch is rounds x "
                              "chunks per round)")
        check_checkpoint_flags(args.checkpoint_dir, args.save_every, args.keep, args.resume)
        env, n = ring_processes(args.model, args.gpus, args.replicas or 1)
        transport = args.transport if args.transport != "auto" else \
            "nccl" if args.backend == "cupy" else "shm"
        replicas, constraints = resolve_layout(
            args.model, args.seqlen, args.host_gb, args.dev_gb, n, backend=args.backend,
            transport=transport, replicas=args.replicas, tokens_per_step=args.tokens_per_step,
            rounds=args.rounds, quiet=env is not None and env.rank != 0,
            placement=args.placement, split_fetch=args.split_fetch)
        constraints = dict(constraints)
        placement = constraints.pop("placement", "cyclic")
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.debug:
        os.environ["DATAFLOW_RING_DEBUG"] = "1"
    # Without --out the launcher still reads rank 0's step times, from a folder it removes.
    out = args.out or ("" if env else tempfile.mkdtemp(prefix="dataflow-ring-"))
    job = RingJob(model=args.model, seqlen=args.seqlen, host_gb=args.host_gb, dev_gb=args.dev_gb,
                  save_weights=bool(args.out) and not args.no_weights, steps=args.steps,
                  seed=args.seed, lr=args.lr,
                  max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
                  backend=args.backend, replicas=replicas, transport=transport,
                  timeout_s=args.timeout, out_dir=out, eager_update=args.eager_update,
                  eval_seqs=args.eval_seqs, trace=args.trace,
                  split_fetch=args.split_fetch,
                  checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                  keep=args.keep, resume=args.resume,
                  constraints=tuple(sorted(constraints.items())), placement=placement)
    return run_job(job, env, n, as_json=args.json, prog=PROG, keep_out=bool(args.out))


def launch_backend(backend: str) -> str:
    """--backend auto as the ranks will resolve it, asked of the driver (no CUDA context in the
    launching process): 'cupy' where NVML shows a GPU, else 'numpy'."""
    if backend != "auto":
        return backend
    try:
        import pynvml

        pynvml.nvmlInit()
        return "cupy" if pynvml.nvmlDeviceGetCount() > 0 else "numpy"
    except Exception:  # noqa: BLE001 - no driver: the NumPy backend
        return "numpy"


def launch_profile(backend: str):
    """The profile the ranks will plan with, found without a CUDA context in this process: the
    CPU's for NumPy, else the one of GPU 0's name as NVML reports it."""
    from dataflow.memplan.plan.profiles import get_profile, profile_for_device

    if backend == "numpy":
        return get_profile("cpu")
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return profile_for_device(name.decode() if isinstance(name, bytes) else name)
    except Exception:  # noqa: BLE001 - no driver here: plan as the ranks' default would
        return get_profile("h100")


def resolve_layout(model: str, seqlen: int, host_gb: float, dev_gb: float, n: int, *,
                   backend: str, transport: str, replicas: int | None,
                   tokens_per_step: int | None, rounds: int | None, quiet: bool = False,
                   placement: str = "cyclic", split_fetch: bool = False):
    """(replicas, plan constraints for every rank) of n processes: the layout the planner
    predicts fastest (dataflow.memplan.search.layout), printed with the alternatives it weighed; with
    replicas given, the chunking of that split that predicts fastest (a full ring, at least as
    many chunks a round as ranks, where one fits). `placement` fixes how a ring deals its
    layers, or 'auto': the faster predicted of layout.WEIGHED_PLACEMENTS; the constraints then
    carry a placement other than cyclic ('placement', RingJob.placement). Raises ConfigError
    naming what does not fit."""
    from dataflow.memplan.search.layout import WEIGHED_PLACEMENTS, choose_layout, layout_text
    from dataflow.memplan.plan.plan import Budget
    from dataflow.ring.worker import model_config

    if rounds and tokens_per_step:
        raise ConfigError("give --rounds or --tokens-per-step, not both (the global batch is "
                          "rounds x chunks per round x replicas)")
    cfg = model_config(model)
    choice = choose_layout(cfg, seqlen, Budget.from_gib(host_gb, dev_gb), launch_profile(backend),
                           n, tokens_per_step=tokens_per_step, transport=transport,
                           ring_size=None if replicas is None else n // replicas,
                           constraints={**({"rounds_per_step": rounds} if rounds else {}),
                                        **({} if placement == "auto" else
                                           {"placement": placement})} or None,
                           placements=WEIGHED_PLACEMENTS if placement == "auto" else
                           (placement,), split_fetch=split_fetch)
    if not quiet:
        print(layout_text(choice), file=sys.stderr, flush=True)
    opt = choice.chosen
    return opt.layout.replicas, tuple(opt.constraints)


def ring_processes(model: str, gpus: int | None, replicas: int):
    """(RankEnv when torchrun / srun launched this process else None, processes in all), after
    checking the ring against the model. Raises ConfigError with one line."""
    from dataflow.ring.launch import rank_env
    from dataflow.ring.worker import model_config

    cfg = model_config(model)
    launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    env = rank_env() if launched else None
    n = env.world_size if env else gpus
    if n is None:
        raise ConfigError("say how many ranks: --gpus N (or launch with torchrun/srun)")
    if env and gpus is not None and gpus != env.world_size:
        raise ConfigError(f"--gpus {gpus} differs from WORLD_SIZE {env.world_size}; drop --gpus "
                          "under torchrun/srun")
    if n % replicas:
        raise ConfigError(f"{n} processes do not split into {replicas} equal rings; use a "
                          "multiple of --replicas")
    ring = n // replicas
    if ring > cfg.n_layers:
        raise ConfigError(f"a ring of {ring} needs at least {ring} layers; {cfg.name} has "
                          f"{cfg.n_layers}: use --gpus {cfg.n_layers * replicas} or fewer")
    return env, n


def run_job(job, env, n: int, *, as_json: bool, prog: str, keep_out: bool = True) -> int:
    """Train `job` as one rank (env given: torchrun / srun launched us) or spawn its n
    processes and summarise them: one line on stderr, and with as_json one JSON document on
    stdout (ring shape, exit codes, losses, step times). keep_out=False removes job.out_dir
    after reading it."""
    from dataflow.ring.launch import launch
    from dataflow.ring.worker import run_rank

    if env is not None:  # one rank of a ring someone else launched
        return run_rank(job, env)
    res = launch(job, n)
    ok = res.first_failure is None
    r = job.replicas
    shape = f"ring of {n}" if r == 1 else f"{r} replicas of a ring of {n // r}"
    info = _rank0(job.out_dir)
    if not keep_out and job.out_dir:
        shutil.rmtree(job.out_dir, ignore_errors=True)
    speed = ""
    if info and info["step_times_s"]:
        times = info["step_times_s"][1:] or info["step_times_s"]
        tok_s = info["tokens_per_step"] / (sum(times) / len(times))
        speed = f"; {tok_s:,.0f} tok/s (mean of steps after the first), loss " \
                f"{info['losses'][-1]:.4f}"
    if info and info.get("eval_loss") is not None:
        speed += f"; eval loss {info['eval_loss']:.4f}"
    print(f"{prog}: {shape} {'finished' if ok else 'FAILED'} in {res.wall_s:.1f} s; exit codes "
          f"{list(res.exit_codes)}" + ("" if ok else f"; rank {res.first_failure} failed first")
          + (speed if ok else ""), file=sys.stderr)
    if as_json:
        doc = {"n_ranks": n // r, "replicas": r, "exit_codes": list(res.exit_codes),
               "wall_s": res.wall_s, "first_failure": res.first_failure,
               "losses": info["losses"] if info else None,
               "step_times_s": info["step_times_s"] if info else None,
               "tokens_per_step": info["tokens_per_step"] if info else None,
               "eval_loss": info.get("eval_loss") if info else None}
        print(json.dumps(doc))
    return 0 if ok else 1


def _rank0(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, "rank0.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
