"""How `dataflow-ring` starts a ring itself: `launch` spawns the job's gpus processes (each one
dataflow.ring.worker.child_main, its RankEnv built here as torchrun would set it), watches them,
and when one dies tells the others to stop (they also notice on their own, by timeout or a dead
neighbour's pid), so no rank is left hanging. Never trains anything itself."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import time
import uuid

from dataflow.ring.env import DEFAULT_PORT, RankEnv
from dataflow.ring.job import RingJob
from dataflow.ring.kinds import TransportKind
from dataflow.ring.shm import abort_ring, cleanup
from dataflow.ring.worker import child_main


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    exit_codes: tuple[int, ...]
    """Per rank: 0 done, 1 failed with a message, negative: killed by that signal."""
    first_failure: int | None
    """The rank that failed first (None when all finished)."""
    wall_s: float


def launch(job: RingJob, *, grace_s: float | None = None,
           run_id: str | None = None) -> LaunchResult:
    """Spawn job.gpus processes (every rank of every replica: job.replicas rings of
    job.ring_size) running `job` and wait for them. When one fails the others are told to stop
    (abort flag) and given `grace_s` (default: the job's timeout) to exit; any still running
    then are terminated. NCCL's NVLink multicast stays off in the ranks (NCCL_NVLS_ENABLE=0
    unless the caller's environment says otherwise)."""
    run_id = run_id or uuid.uuid4().hex[:12]
    grace_s = job.timeout_s if grace_s is None else grace_s
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")  # no forked copies of a parent's arenas or threads
    procs = []
    port = DEFAULT_PORT + (int(run_id[:4], 16) % 1000 if re.fullmatch(r"[0-9a-f]{4,}", run_id)
                           else 0)
    for r in range(job.gpus):
        env = RankEnv(rank=r, gpus=job.gpus, local_rank=r, master_addr="127.0.0.1",
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
                if job.transport is not TransportKind.NCCL:  # shm, or auto that chose it
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
        if job.transport is not TransportKind.NCCL:  # shm, or auto that chose it
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
