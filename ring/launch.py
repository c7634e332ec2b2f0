"""Where a ring process learns who it is, and how `dataflow-ring` starts a ring itself. Rank,
world size and local rank come from the usual variables (RANK / WORLD_SIZE / LOCAL_RANK as
torchrun sets them, else SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), the rendezvous from
MASTER_ADDR / MASTER_PORT. `launch` spawns N processes, watches them, and when one dies tells the
others to stop (they also notice on their own, by timeout or a dead neighbour's pid), so no rank
is left hanging. Never trains anything itself."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import re
import time
import uuid

from dataflow.models.errors import ConfigError
from dataflow.settings import settings_from_env

DEFAULT_PORT = 29517
"""The rendezvous port (NCCL id exchange) when neither DATAFLOW_RING_PORT nor MASTER_PORT is set
(with MASTER_PORT: MASTER_PORT + 1, since torchrun's agent holds MASTER_PORT itself)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    """Which GPU of this host the rank uses."""
    master_addr: str
    master_port: int
    """The ring's own rendezvous port at master_addr (DATAFLOW_RING_PORT, else MASTER_PORT + 1,
    else DEFAULT_PORT)."""
    run_id: str
    """Names this ring's shared-memory segments: DATAFLOW_RING_ID, TORCHELASTIC_RUN_ID or
    SLURM_JOB_ID, else the master port."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RankEnv":
        return cls(**json.loads(text))


def _int(environ, names: tuple[str, ...], what: str) -> int | None:
    for name in names:
        text = environ.get(name)
        if text is None or text == "":
            continue
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not a whole number ({what})") from None
    return None


def rank_env(environ=None) -> RankEnv:
    """This process's place in the ring, from torchrun's or Slurm's variables."""
    environ = os.environ if environ is None else environ
    rank = _int(environ, ("RANK", "SLURM_PROCID"), "this process's rank")
    world = _int(environ, ("WORLD_SIZE", "SLURM_NTASKS"), "the number of ranks")
    if rank is None or world is None:
        raise ConfigError("no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun) in "
                          "the environment; launch with torchrun --nproc-per-node N, srun, or "
                          "dataflow-ring --gpus N (which spawns the ranks)")
    local = _int(environ, ("LOCAL_RANK", "SLURM_LOCALID"), "the GPU index on this host")
    ring = settings_from_env(environ)
    port = _int({"DATAFLOW_RING_PORT": ring.ring_port}, ("DATAFLOW_RING_PORT",),
                "the ring's rendezvous port")
    if port is None:  # torchrun's agent serves its own store at MASTER_PORT: take the next one
        master = _int(environ, ("MASTER_PORT",), "the master port")
        port = None if master is None else master + 1
    if not 1 <= world or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside world size {world}; expected 0 <= RANK < "
                          "WORLD_SIZE")
    port = DEFAULT_PORT if port is None else port
    if not 0 < port < 65536:
        raise ConfigError(f"the ring's rendezvous port {port} (DATAFLOW_RING_PORT, else "
                          "MASTER_PORT + 1) is not a TCP port (1..65535)")
    run_id = (ring.ring_id or environ.get("TORCHELASTIC_RUN_ID")
              or environ.get("SLURM_JOB_ID") or f"p{port}")
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:40]
    return RankEnv(rank=rank, world_size=world, local_rank=rank if local is None else local,
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                   run_id=run_id)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    exit_codes: tuple[int, ...]
    """Per rank: 0 done, 1 failed with a message, negative: killed by that signal."""
    first_failure: int | None
    """The rank that failed first (None when all finished)."""
    wall_s: float


def launch(job, n_ranks: int, *, grace_s: float | None = None,
           run_id: str | None = None) -> LaunchResult:
    """Spawn `n_ranks` processes (every rank of every replica: job.replicas rings of
    n_ranks / job.replicas) running `job` (a dataflow.ring.worker.RingJob) and wait for them. When one
    fails the others are told to stop (abort flag) and given `grace_s` (default: the job's
    timeout) to exit; any still running then are terminated. NCCL's NVLink multicast stays off
    in the ranks (NCCL_NVLS_ENABLE=0 unless the caller's environment says otherwise)."""
    from dataflow.ring.shm import abort_ring, cleanup
    from dataflow.ring.worker import child_main

    run_id = run_id or uuid.uuid4().hex[:12]
    grace_s = job.timeout_s if grace_s is None else grace_s
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")  # no forked copies of a parent's arenas or threads
    procs = []
    port = DEFAULT_PORT + (int(run_id[:4], 16) % 1000 if re.fullmatch(r"[0-9a-f]{4,}", run_id)
                           else 0)
    for r in range(n_ranks):
        env = RankEnv(rank=r, world_size=n_ranks, local_rank=r, master_addr="127.0.0.1",
                      master_port=port, run_id=run_id)
        p = ctx.Process(target=child_main, args=(job.to_json(), env.to_json()),
                        name=f"ring-rank{r}", daemon=False)
        p.start()
        procs.append(p)
    t0 = time.monotonic()
    first = None
    stop_at = None
    terminated: set[int] = set()
    try:
        while any(p.is_alive() for p in procs):
            failed = [r for r, p in enumerate(procs)
                      if not p.is_alive() and p.exitcode not in (0, None)]
            if first is None and failed:
                # A neighbour may exit on noticing a death before this poll has reaped the dead
                # rank: look again a moment later, and blame a rank killed by a signal before
                # one that exited with an error.
                time.sleep(0.5)
                failed = [r for r, p in enumerate(procs)
                          if not p.is_alive() and p.exitcode not in (0, None)]
                first = min(failed, key=lambda r: (procs[r].exitcode >= 0, r))
                if job.transport != "nccl":  # shm, or auto that chose it
                    abort_ring(run_id)
                stop_at = time.monotonic() + grace_s
            if stop_at is not None and time.monotonic() > stop_at:
                for r, p in enumerate(procs):
                    if p.is_alive():
                        terminated.add(r)
                        p.terminate()
                break
            time.sleep(0.05)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if job.transport != "nccl":  # shm, or auto that chose it
            cleanup(run_id)
    codes = tuple(p.exitcode if p.exitcode is not None else -9 for p in procs)
    if first is None:
        first = next((r for r, c in enumerate(codes) if c != 0), None)
    # A rank killed by a signal (not by us) is the cause; ranks that exited with an error were
    # reacting to it, even when one of them was seen first.
    killed = [r for r, c in enumerate(codes) if c < 0 and r not in terminated]
    if killed and codes[first] >= 0:
        first = killed[0]
    return LaunchResult(codes, first, time.monotonic() - t0)
