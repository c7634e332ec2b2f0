"""The one place a ring process is set up, for the worker and the RingEngine alike: this rank's
plan under the per-device budgets, its backend (its GPU), its transport and its blocks
initialised as one device would. Counts: `gpus` is the job's processes (RankEnv.gpus),
`ring_size` the ranks of one ring (gpus / replicas). Never chooses the layout (the caller
passes replicas and constraints: dataflow.ring.layout) and never spawns processes."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from dataflow.backends import make_backend
from dataflow.engine import default_profile
from dataflow.instrument import TracingBackend
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget, GradAccum
from dataflow.memplan.plan.split import split_memory_map
from dataflow.memplan.search.cost import predict
from dataflow.memplan.search.ring_plan import make_rank_plan, ring_profile
from dataflow.memplan.step.ring_rendezvous import refuse_rendezvous_deadlock
from dataflow.models.errors import ConfigError
from dataflow.ring.env import RankEnv
from dataflow.ring.kinds import TransportKind
from dataflow.ring.nccl import NcclTransport
from dataflow.ring.rank import RingRank
from dataflow.ring.shm import SharedMemoryTransport


def ring_size(env: RankEnv, replicas: int) -> int:
    """Ranks per ring: the job's processes divided among the replicas."""
    if replicas < 1 or env.gpus % replicas:
        raise ConfigError(f"{env.gpus} processes do not split into {replicas} equal "
                          "rings; use a process count that is a multiple of the replicas")
    return env.gpus // replicas


def make_transport(kind: TransportKind, env: RankEnv, replicas: int, timeout_s: float):
    """The transport of process env.rank: rank env.rank % ring_size of ring
    env.rank // ring_size. `kind` is NCCL or SHM (TransportKind.resolve)."""
    n = ring_size(env, replicas)
    if kind is TransportKind.NCCL:
        return NcclTransport(env, ring_size=n, timeout_s=timeout_s)
    return SharedMemoryTransport(env.rank % n, n, env.run_id, replica=env.rank // n,
                                 replicas=replicas, timeout_s=timeout_s)


def make_rank_backend(backend: str, kind: TransportKind, env: RankEnv):
    """NumPy, or CuPy on this rank's GPU: LOCAL_RANK for NCCL (one GPU per rank), else
    LOCAL_RANK modulo the GPUs present (ranks sharing GPUs through shared memory)."""
    if backend == "numpy":
        return make_backend("numpy")
    try:
        import cupy as cp  # optional: only a GPU rank counts the GPUs

        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: make_backend says which
        return make_backend(backend)
    if kind is TransportKind.NCCL and env.local_rank >= count:
        raise ConfigError(f"process {env.rank} needs GPU {env.local_rank} (LOCAL_RANK) but this "
                          f"host has {count}: the NCCL transport takes one GPU per rank (the "
                          "shared-memory transport lets ranks share GPUs)")
    device = env.local_rank if kind is TransportKind.NCCL else env.local_rank % max(1, count)
    return make_backend(backend, device=device)


def open_rank(cfg, seqlen: int, host_gb: float, dev_gb: float, *, env: RankEnv,
              replicas: int = 1, backend: str = "auto",
              transport: TransportKind = TransportKind.AUTO, timeout_s: float = 120.0,
              seed: int = 0, optimizer=None, lr_schedule: Callable[[int], float] | None = None,
              grad_accum: GradAccum = GradAccum.BF16, profile=None,
              deferred_update: bool = True, trace: bool = False, split_fetch: bool = False,
              split_update: bool = False, **constraints):
    """(RingRank, transport) of this process: its rank's plan under the per-device budgets,
    its backend, its transport and its blocks initialised as one device would.
    deferred_update: as the Engine's (each step's AdamW inside the next step's first round).
    trace: wrap the backend in a TracingBackend; each step's breakdown is then the rank's
    `last_breakdown`. split_fetch: with replicas, each fetches 1/R of every streamed weight use
    and gathers the rest from the others (RankPlan.split_fetch); split_update: with replicas,
    each updates its part of every block (RankPlan.split_update). A 'precision' among the
    constraints is the rank plan's and its backend's (dataflow.precision; a backend without it
    refuses, by name, before planning)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (KINDS.md)
    n = ring_size(env, replicas)
    # AUTO takes its GPU as NCCL would (LOCAL_RANK); the backend then settles the transport
    gpu_kind = TransportKind.NCCL if transport is TransportKind.AUTO else transport
    be = make_rank_backend(backend, gpu_kind, env)
    be.set_precision(constraints.get("precision", "bf16"))
    kind = transport.resolve(be.name)
    if trace:
        be = TracingBackend(be)
    profile = profile or default_profile(be)  # as the Engine: this GPU's (or a probed) profile
    split_fetch = bool(split_fetch) and replicas > 1
    split_update = bool(split_update) and replicas > 1
    profile = ring_profile(profile, env.gpus, kind.value, replicas)  # NCCL's own memory
    _state_parts(constraints, replicas, split_update)
    rp = _rank_plan(cfg, seqlen, Budget.from_gib(host_gb, dev_gb), profile, n, env.rank % n,
                    replicas, split_update, grad_accum=grad_accum, split_fetch=split_fetch,
                    **constraints)
    if kind is TransportKind.NCCL and n > 1 and rp.vocab_parallel:
        # its sends go both ways round the ring on one send stream: refuse, before any
        # communicator is made, a schedule whose rendezvous sends could wait on each other
        # (every rank planned as its own process plans it)
        others = [rp if r == rp.rank else _rank_plan(
            cfg, seqlen, Budget.from_gib(host_gb, dev_gb), profile, n, r, replicas,
            split_update, grad_accum=grad_accum, split_fetch=split_fetch, **constraints)
            for r in range(n)]
        for update in ("end", "deferred") if deferred_update else ("end",):  # step 1, then on
            refuse_rendezvous_deadlock(others, update, what="the vocabulary-parallel head")
    tr = make_transport(kind, env, replicas, timeout_s)
    try:
        return RingRank(rp, be, tr, seed=seed, optimizer=optimizer, lr_schedule=lr_schedule,
                        deferred_update=deferred_update), tr
    except BaseException:
        tr.abort("setup failed")
        tr.close()
        raise


def _rank_plan(cfg, seqlen: int, budget: Budget, profile, n: int, rank: int, replicas: int,
               split_update: bool, **constraints):
    """This rank's plan (make_rank_plan). A split update's replica of R holds m / v for one
    part of R in its plan (Plan.state_parts R), so its arena allocates the parts it planned:
    searched so where the constraints say (a layout's parted option) or where the whole plan
    does not fit; else the whole plan's decisions (what a layout's whole option was predicted
    with) with its m / v cut to the part (parted_plan)."""
    plan = functools.partial(make_rank_plan, cfg, seqlen, budget, profile, n, rank,
                             replicas=replicas)
    if not split_update:
        return plan(**constraints)
    if constraints.get("state_parts", 1) == 1:
        try:
            return parted_plan(plan(**constraints), replicas)
        except InfeasibleBudget:  # fits only with m / v for the part: plan it so
            pass
    return dataclasses.replace(plan(**dict(constraints, state_parts=replicas)),
                               split_update=True)


def parted_plan(rp, replicas: int):
    """Rank plan `rp` (planned whole) as a split update's replica of `replicas`: the same
    decisions with m / v of its layers and head for one part (Plan.state_parts, the memory map
    split.split_memory_map, its estimate the cost model's of the part's AdamW)."""
    plan = dataclasses.replace(rp.plan, state_parts=replicas,
                               memory=split_memory_map(rp.plan, replicas))
    plan = dataclasses.replace(plan, prediction=predict(plan, plan.profile))
    return dataclasses.replace(rp, plan=plan, split_update=True)


def _state_parts(constraints: dict, replicas: int, split_update: bool) -> int:
    """The rank plan's Plan.state_parts: R for a split update's replica of R, else 1; a
    'state_parts' among the constraints (a layout's choice) must say the same."""
    parts = replicas if split_update else 1
    given = constraints.get("state_parts", parts)
    if given != parts:
        raise ConfigError(f"plan constraint state_parts {given!r} does not match "
                          f"{replicas} replica(s) {'with' if split_update else 'without'} "
                          f"--split-update (it must be {parts}); leave it out, or "
                          f"{'drop' if split_update else 'add'} --split-update")
    return parts
