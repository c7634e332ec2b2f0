"""Where a ring process learns who it is: its rank, the job's process count and its GPU come from
the usual variables (RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them, else SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID), the rendezvous from MASTER_ADDR / MASTER_PORT. Never starts a
process and never opens a transport."""

from __future__ import annotations

import dataclasses
import json
import os
import re

from dataflow.models.errors import ConfigError
from dataflow.settings import settings_from_env

DEFAULT_PORT = 29517
"""The rendezvous port (NCCL id exchange) when neither DATAFLOW_RING_PORT nor MASTER_PORT is set
(with MASTER_PORT: MASTER_PORT + 1, since torchrun's agent holds MASTER_PORT itself)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankEnv:
    rank: int
    """This process's place among all of the job's processes (replica-major)."""
    gpus: int
    """Processes in the job, every rank of every replica (WORLD_SIZE, SLURM_NTASKS)."""
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
    gpus = _int(environ, ("WORLD_SIZE", "SLURM_NTASKS"), "the number of ranks")
    if rank is None or gpus is None:
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
    if not 1 <= gpus or not 0 <= rank < gpus:
        raise ConfigError(f"rank {rank} is outside world size {gpus}; expected 0 <= RANK < "
                          "WORLD_SIZE")
    port = DEFAULT_PORT if port is None else port
    if not 0 < port < 65536:
        raise ConfigError(f"the ring's rendezvous port {port} (DATAFLOW_RING_PORT, else "
                          "MASTER_PORT + 1) is not a TCP port (1..65535)")
    run_id = (ring.ring_id or environ.get("TORCHELASTIC_RUN_ID")
              or environ.get("SLURM_JOB_ID") or f"p{port}")
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:40]
    return RankEnv(rank=rank, gpus=gpus, local_rank=rank if local is None else local,
                   master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                   run_id=run_id)
