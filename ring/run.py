"""What `dataflow-ring` and `dataflow-demo --gpus` do once their arguments are parsed: check the
job's process count against the model and the launcher's environment, then train the RingJob as
one rank (torchrun / srun started this process) or spawn its gpus processes and summarise them
(one line on stderr, optionally one JSON document on stdout). Never parses a command line and
never chooses the layout (dataflow.ring.layout does)."""

from __future__ import annotations

import json
import os
import shutil
import sys

from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import is_hf_dir
from dataflow.ring.env import RankEnv, rank_env
from dataflow.ring.job import RingJob, model_config
from dataflow.ring.launch import launch
from dataflow.ring.worker import run_rank


def ring_processes(model: str, gpus: int | None, replicas: int) -> tuple[RankEnv | None, int]:
    """(RankEnv when torchrun / srun launched this process else None, the job's gpus: processes
    in all), after checking the ring against the model. Raises ConfigError with one line."""
    cfg = model_config(model)
    launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    env = rank_env() if launched else None
    asked = gpus
    gpus = env.gpus if env else asked
    if gpus is None:
        raise ConfigError("say how many ranks: --gpus N (or launch with torchrun/srun)")
    if env and asked is not None and asked != env.gpus:
        raise ConfigError(f"--gpus {asked} differs from WORLD_SIZE {env.gpus}; drop --gpus "
                          "under torchrun/srun")
    if gpus % replicas:
        raise ConfigError(f"{gpus} processes do not split into {replicas} equal rings; use a "
                          "multiple of --replicas")
    ring_size = gpus // replicas
    if ring_size > cfg.n_layers:
        raise ConfigError(f"a ring of {ring_size} needs at least {ring_size} layers; {cfg.name} "
                          f"has {cfg.n_layers}: use --gpus {cfg.n_layers * replicas} or fewer")
    if is_hf_dir(model) and (env is None or env.rank == 0):
        # A ring rank initialises its blocks from --seed (ring.rank); it has no weight loader
        print(f"note: {model} is a Hugging Face directory: the ring trains its shape from a "
              "random initialisation (--seed) and does not load its weights; dataflow-demo "
              "on one GPU fine-tunes them", file=sys.stderr)
    return env, gpus


def run_job(job: RingJob, env: RankEnv | None, *, as_json: bool, prog: str,
            keep_out: bool = True) -> int:
    """Train `job` as one rank (env given: torchrun / srun launched us) or spawn its job.gpus
    processes and summarise them: one line on stderr, and with as_json one JSON document on
    stdout (ring shape, exit codes, losses, step times). keep_out=False removes job.out_dir
    after reading it."""
    if env is not None:  # one rank of a ring someone else launched
        return run_rank(job, env)
    res = launch(job)
    ok = res.first_failure is None
    r, ring_size = job.replicas, job.ring_size
    shape = f"ring of {ring_size}" if r == 1 else f"{r} replicas of a ring of {ring_size}"
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
        doc = {"n_ranks": ring_size, "replicas": r, "exit_codes": list(res.exit_codes),
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
