"""The ring behind the Engine API: `Engine(model, host_gb=..., dev_gb=..., seqlen=...,
ring=Ring())` in every process of a ring (launched by torchrun, srun or `dataflow-ring`) returns a
RingEngine, this process's rank, which trains on the global batch as the Engine does. Also the
one place a ring process is set up (plan, backend, transport, rank), for the worker and the
Engine alike. Never spawns processes (dataflow.ring.launch does) and never decides placement."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import numpy as np

from dataflow.ring.launch import RankEnv, rank_env


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ring:
    """How this process joins a ring; pass it as Engine(..., ring=Ring(...))."""

    replicas: int | None = None
    """Data-parallel copies of the ring: WORLD_SIZE processes form `replicas` rings of
    WORLD_SIZE / replicas ranks (layer i on rank i mod that). None (the default): the layout
    the planner predicts fastest for WORLD_SIZE GPUs (dataflow.memplan.search.layout.choose_layout),
    the same in every process; the engine's rank_plan (replicas, n_ranks, placement) says
    what it chose."""
    transport: str = "auto"
    """'nccl' (one GPU per rank), 'shm' (one host: NumPy, or ranks sharing GPUs) or 'auto'
    (nccl on a GPU backend, shm on NumPy)."""
    timeout_s: float = 120.0
    """How long a rank waits for another before failing with a RingError naming it."""
    placement: str = "cyclic"
    """How the ring deals its layers (dataflow.memplan.plan.ranks.PLACEMENTS): 'cyclic' (layer i
    on rank i mod N), 'balanced' (the head's rank owns fewer layers: it also runs the head),
    'contiguous', or 'auto': the one the layout chooser predicts fastest (with replicas None).
    A 'placement' in plan_options takes precedence."""
    split_fetch: bool = False
    """With replicas: each fetches 1/R of every streamed weight use from its host memory and
    gathers the rest from the other replicas over NVLink (RankPlan.split_fetch). Off by
    default: on 2 H200s at 60/24 it measured 2.5 % slower than each fetching everything (8b,
    16k chunks, copies already hidden; docs/ring.md)."""
    env: RankEnv | None = None
    """This process's place; default: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT (or SLURM_*) from the environment."""

    def engine(self, model, **options) -> "RingEngine":
        """What Engine(model, ..., ring=self) returns."""
        return RingEngine(self, model, **options)


def transport_kind(kind: str, backend_name: str) -> str:
    if kind == "auto":
        return "shm" if backend_name == "numpy" else "nccl"
    if kind not in ("nccl", "shm"):
        from dataflow.models.errors import ConfigError

        raise ConfigError(f"unknown ring transport '{kind}'; choose auto, nccl or shm")
    return kind


def make_transport(kind: str, env: RankEnv, replicas: int, timeout_s: float):
    """The transport of process env.rank: rank env.rank % N of ring env.rank // N."""
    n = ring_size(env, replicas)
    if kind == "nccl":
        from dataflow.ring.nccl import NcclTransport

        return NcclTransport(env, ring_size=n, timeout_s=timeout_s)
    from dataflow.ring.shm import SharedMemoryTransport

    return SharedMemoryTransport(env.rank % n, n, env.run_id, replica=env.rank // n,
                                 replicas=replicas, timeout_s=timeout_s)


def ring_size(env: RankEnv, replicas: int) -> int:
    """Ranks per ring: the processes divided among the replicas."""
    if replicas < 1 or env.world_size % replicas:
        from dataflow.models.errors import ConfigError

        raise ConfigError(f"{env.world_size} processes do not split into {replicas} equal "
                          "rings; use a process count that is a multiple of the replicas")
    return env.world_size // replicas


def make_rank_backend(backend: str, kind: str, env: RankEnv):
    """NumPy, or CuPy on this rank's GPU: LOCAL_RANK for NCCL (one GPU per rank), else
    LOCAL_RANK modulo the GPUs present (ranks sharing GPUs through shared memory)."""
    from dataflow.backends import make_backend

    if backend == "numpy":
        return make_backend("numpy")
    try:
        import cupy as cp

        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: make_backend says which
        return make_backend(backend)
    if kind == "nccl" and env.local_rank >= count:
        from dataflow.models.errors import ConfigError

        raise ConfigError(f"process {env.rank} needs GPU {env.local_rank} (LOCAL_RANK) but this "
                          f"host has {count}: the NCCL transport takes one GPU per rank (the "
                          "shared-memory transport lets ranks share GPUs)")
    device = env.local_rank if kind == "nccl" else env.local_rank % max(1, count)
    return make_backend(backend, device=device)


def open_rank(cfg, seqlen: int, host_gb: float, dev_gb: float, *, env: RankEnv,
              replicas: int = 1, backend: str = "auto", transport: str = "auto",
              timeout_s: float = 120.0, seed: int = 0, optimizer=None,
              lr_schedule: Callable[[int], float] | None = None, grad_accum: str = "bf16",
              profile=None, deferred_update: bool = True, trace: bool = False,
              split_fetch: bool = False, **constraints):
    """(RingRank, transport) of this process: its rank's plan under the per-device budgets,
    its backend, its transport and its blocks initialised as one device would.
    deferred_update: as the Engine's (each step's AdamW inside the next step's first round).
    trace: wrap the backend in a TracingBackend; each step's breakdown is then the rank's
    `last_breakdown`. split_fetch: with replicas, each fetches 1/R of every streamed weight use
    and gathers the rest from the others (RankPlan.split_fetch)."""
    from dataflow.engine import default_profile
    from dataflow.memplan.plan.plan import Budget, GradAccum
    from dataflow.memplan.search.ring_plan import make_rank_plan, ring_profile
    from dataflow.ring.rank import RingRank

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (KINDS.md)
    n = ring_size(env, replicas)
    be = make_rank_backend(backend, transport if transport != "auto" else "nccl", env)
    kind = transport_kind(transport, be.name)
    if trace:
        from dataflow.instrument import TracingBackend

        be = TracingBackend(be)
    profile = profile or default_profile(be)  # as the Engine: this GPU's (or a probed) profile
    split_fetch = bool(split_fetch) and replicas > 1
    profile = ring_profile(profile, env.world_size, kind, replicas)  # NCCL's own memory
    rp = make_rank_plan(cfg, seqlen, Budget.from_gib(host_gb, dev_gb), profile, n, env.rank % n,
                        replicas=replicas, grad_accum=GradAccum(grad_accum),
                        split_fetch=split_fetch, **constraints)
    tr = make_transport(kind, env, replicas, timeout_s)
    try:
        return RingRank(rp, be, tr, seed=seed, optimizer=optimizer, lr_schedule=lr_schedule,
                        deferred_update=deferred_update), tr
    except BaseException:
        tr.abort("setup failed")
        tr.close()
        raise


def _choose_replicas(cfg, seqlen, host_gb, dev_gb, env, backend, transport, profile,
                     seqs_per_step, options, split_fetch: bool = False) -> tuple[int, dict]:
    """(replicas, plan constraints) of the layout the planner predicts fastest for the
    world's processes, planned as the ranks will plan (their backend's profile, NCCL's reserve).
    A global batch (seqs_per_step) is kept exactly: only splits that divide it are weighed."""
    from dataflow.memplan.search.layout import WEIGHED_PLACEMENTS, choose_layout
    from dataflow.memplan.plan.plan import Budget
    from dataflow.models.errors import ConfigError
    from dataflow.ring.cli import launch_profile

    kind = backend if backend != "auto" else _backend_kind()
    prof = profile or launch_profile(kind)
    tr = transport if transport != "auto" else ("shm" if kind == "numpy" else "nccl")
    budget, world = Budget.from_gib(host_gb, dev_gb), env.world_size
    if seqs_per_step is None:
        c = choose_layout(cfg, seqlen, budget, prof, world, transport=tr,
                          constraints=options or None, single_tok_per_s=None,
                          placements=WEIGHED_PLACEMENTS, split_fetch=split_fetch)
        return c.chosen.layout.replicas, dict(c.chosen.constraints)
    best = None
    for n in range(1, min(world, cfg.n_layers) + 1):
        r = world // n
        if world % n or seqs_per_step % r:
            continue
        try:
            c = choose_layout(cfg, seqlen, budget, prof, world, transport=tr, ring_size=n,
                              constraints=dict(options, seqs_per_step=seqs_per_step // r),
                              single_tok_per_s=None, placements=WEIGHED_PLACEMENTS,
                              split_fetch=split_fetch)
        except ConfigError:  # this split does not fit (InfeasibleBudget included)
            continue
        if best is None or c.chosen.on(c.link).tok_per_s > best.on(c.link).tok_per_s:
            best = c.chosen
    if best is None:
        raise ConfigError(f"no split of {world} processes into replicas of a ring trains "
                          f"{seqs_per_step} sequences a step within {host_gb:g} GiB host and "
                          f"{dev_gb:g} GiB device each for {cfg.name} at seqlen {seqlen}")
    return best.layout.replicas, dict(best.constraints)


def _backend_kind() -> str:
    try:
        import cupy as cp

        return "cupy" if cp.cuda.runtime.getDeviceCount() > 0 else "numpy"
    except Exception:  # noqa: BLE001 - no CuPy or no GPU
        return "numpy"


def _whole(total: int, parts: int, what: str, by: str) -> int:
    if total % parts:
        from dataflow.models.errors import ConfigError

        raise ConfigError(f"{what} {total} is not a multiple of {by} {parts}")
    return total // parts


class RingEngine:
    """This process's rank of a ring, with the Engine's training surface: train_step on the
    global batch (the same tokens on every process) returns a dataflow.engine.StepResult with
    the whole ring's loss, tokens and throughput (MFU over every GPU of every replica; HFU is
    not computed for a ring: NaN). save_checkpoint / load_checkpoint write and read checkpoints
    of the whole model in the Engine's format (collective: every process calls them; one
    device loads a ring's checkpoint and a ring one device's); eval_step is the Engine's, over
    the whole ring. state_dict is not built for a ring: weights() gives this rank's blocks by
    global key. As on one device, each step's AdamW runs inside the next step's first round
    unless deferred_update=False, and weights(), eval_step, save_checkpoint and
    load_checkpoint run a pending one first."""

    def __init__(self, ring: Ring, model, *, host_gb: float, dev_gb: float, seqlen: int,
                 backend: str = "auto", seed: int = 0, lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                 optimizer=None, lr_schedule: Callable[[int], float] | None = None,
                 plan_options: dict | None = None, seqs_per_step: int | None = None,
                 tokens_per_step: int | None = None, grad_accum: str = "bf16", profile=None,
                 deferred_update: bool = True):
        from dataflow.optimizer import AdamWConfig
        from dataflow.models.config import ModelConfig
        from dataflow.models.hf import model_config

        self.cfg = model if isinstance(model, ModelConfig) else model_config(model)
        self.env = ring.env or rank_env()
        opt = optimizer or AdamWConfig(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                       weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        options = dict(plan_options or {})
        if ring.placement != "auto":  # else choose_layout weighs the placements
            options.setdefault("placement", ring.placement)
        if tokens_per_step is not None:
            seqs_per_step = _whole(tokens_per_step, seqlen, "tokens_per_step", "seqlen")
        replicas = ring.replicas
        if replicas is None:  # the planner's layout for this many processes
            replicas, chosen = _choose_replicas(self.cfg, seqlen, host_gb, dev_gb, self.env,
                                                backend, ring.transport, profile, seqs_per_step,
                                                options, ring.split_fetch)
            options.update(chosen)
        elif seqs_per_step is not None:  # the global batch: each replica plans its share
            options["seqs_per_step"] = _whole(seqs_per_step, replicas, "seqs_per_step",
                                              "replicas")
        self.rank, self.transport = open_rank(
            self.cfg, seqlen, host_gb, dev_gb, env=self.env, replicas=replicas,
            backend=backend, transport=ring.transport, timeout_s=ring.timeout_s, seed=seed,
            optimizer=opt, lr_schedule=lr_schedule, grad_accum=grad_accum, profile=profile,
            deferred_update=deferred_update, split_fetch=ring.split_fetch, **options)
        self.rank_plan = self.rank.rp
        self.plan = self.rank_plan.plan
        self._closed = False

    @property
    def seqs_per_step(self) -> int:
        """Rows of the global batch: every replica's sequences per step."""
        return self.plan.chunking.seqs_per_step * self.rank_plan.replicas

    def train_step(self, tokens, labels=None, *, doc_ids=None, position_ids=None,
                   lr: float | None = None):
        """One optimizer step of the whole ring on the global batch (seqs_per_step rows of
        seqlen + 1 ids, the same on every process; labels / doc_ids / position_ids as
        Engine.train_step). Collective: every process of the ring calls it."""
        from dataflow.batch import make_batch
        from dataflow.engine import StepResult
        from dataflow.models.flops import flop_model_version, model_flops_per_seq

        self._check_open()
        ch = self.plan.chunking
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=self.cfg.vocab_size, rows=self.seqs_per_step,
                           seqlen=ch.seqlen)
        opt = self.rank.optimizer
        if lr is None:
            lr = opt.schedule(opt.step_count + 1) if opt.schedule else opt.config.lr
        saved = opt.config, opt.schedule
        opt.config, opt.schedule = dataclasses.replace(opt.config, lr=lr), None
        t0 = time.perf_counter()
        try:
            stats = self.rank.train_step(batch)
        finally:
            opt.config, opt.schedule = saved
        t = max(time.perf_counter() - t0, 1e-12)
        flops = model_flops_per_seq(self.cfg, ch.seqlen) * self.seqs_per_step
        gpus = self.env.world_size
        return StepResult(
            step=opt.step_count, loss=stats.loss,
            round_losses=tuple(r.loss_sum / max(r.tokens, 1) for r in stats.rounds),
            tokens=stats.tokens, step_time_s=t, tok_per_s=stats.tokens / t,
            model_tflop_per_s=flops / t / 1e12,
            mfu=flops / t / (self.plan.profile.peak_bf16_flop_per_s * gpus), hfu=float("nan"),
            flop_model_version=flop_model_version(self.cfg), h2d_bytes=stats.h2d_bytes,
            d2h_bytes=stats.d2h_bytes, lr=lr, grad_norm=stats.grad_norm,
            loss_tokens=batch.counted, aux_loss=stats.aux_loss, z_loss=stats.z_loss)

    def eval_step(self, tokens, labels=None, *, doc_ids=None, position_ids=None) -> float:
        """The mean loss over the counted targets of `tokens` (any number of rows of seqlen + 1
        ids, the same on every process; labels / doc_ids / position_ids as train_step), forward
        only, as Engine.eval_step: no weight, AdamW state or step count changes. Rows are padded
        to whole rounds of every replica, which each evaluate their share. Collective."""
        from dataflow.batch import make_batch
        from dataflow.models.errors import ConfigError

        self._check_open()
        ch = self.plan.chunking
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=self.cfg.vocab_size, seqlen=ch.seqlen,
                           pad_rows_to=ch.seqs_per_round * self.rank_plan.replicas)
        if batch.counted == 0:
            raise ConfigError("every label of the evaluation batch is -100; keep at least one")
        return self.rank.evaluate(batch).loss

    def weights(self) -> dict[str, np.ndarray]:
        """Host copies of this rank's blocks ('embed', 'layer<global index>', 'head')."""
        return self.rank.weights()

    def save_checkpoint(self, path, *, data: dict | None = None, rng=None,
                        extra: dict | None = None, keep: int | None = None):
        """Save the whole ring's weights, AdamW m and v, step and schedule (and process 0's
        data / rng / extra) to `path/step_<step>`, as Engine.save_checkpoint does; every rank
        writes its own blocks. Collective; `path` must be one directory that every process
        sees. Returns the checkpoint's path on every process."""
        from dataflow.ring.checkpoint import save_ring_checkpoint

        self._check_open()
        return save_ring_checkpoint(self.rank, self.transport, self.cfg, path, data=data,
                                    rng=rng, extra=extra, keep=keep)

    def load_checkpoint(self, path, *, verify: bool = True, allow_changes: bool = False):
        """Restore this rank's blocks, the step and the schedule from a checkpoint of the whole
        model (one device's or any ring's); as Engine.load_checkpoint, and if any process
        refuses the checkpoint (damaged file, other model or settings) none loads anything.
        Collective. Returns a dataflow.checkpoint.CheckpointInfo."""
        from dataflow.ring.checkpoint import load_ring_checkpoint

        self._check_open()
        return load_ring_checkpoint(self.rank, self.transport, self.cfg, path, verify=verify,
                                    allow_changes=allow_changes)

    def _check_open(self) -> None:
        if self._closed:
            from dataflow.models.errors import ConfigError

            raise ConfigError("this RingEngine is closed; create a new one")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.rank.close()

    def __enter__(self) -> "RingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
