"""The ring behind the Engine API: `Engine(model, host_gb=..., dev_gb=..., seqlen=...,
ring=Ring())` in every process of a ring (launched by torchrun, srun or `dataflow-ring`) returns a
RingEngine, this process's rank, which trains on the global batch as the Engine does. The
caller's strings (transport, placement, grad_accum) are parsed here; the rank is set up by
dataflow.ring.bootstrap, the layout chosen by dataflow.ring.layout. Never spawns processes
(dataflow.ring.launch does) and never decides placement."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from dataflow.batch import make_batch
from dataflow.engine import StepResult
from dataflow.memplan.plan.plan import GradAccum
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.flops import flop_model_version, model_flops_per_seq
from dataflow.models.hf_config import model_config
from dataflow.optimizer import AdamWConfig
from dataflow.ring.bootstrap import open_rank
from dataflow.ring.checkpoint import load_ring_checkpoint, save_ring_checkpoint
from dataflow.ring.env import RankEnv, rank_env
from dataflow.ring.job import model_weights_dir
from dataflow.ring.kinds import PlacementChoice, TransportKind
from dataflow.ring.layout import choose_ring_layout, launch_profile, process_backend


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ring:
    """How this process joins a ring; pass it as Engine(..., ring=Ring(...))."""

    replicas: int | None = None
    """Data-parallel copies of the ring: the job's gpus processes (WORLD_SIZE) form `replicas`
    rings of ring_size = gpus / replicas ranks (layer i on rank i mod ring_size). None (the
    default): the layout the planner predicts fastest for that many GPUs
    (dataflow.ring.layout.choose_ring_layout), the same in every process; the engine's
    rank_plan (replicas, n_ranks: the ring_size, placement) says what it chose."""
    transport: TransportKind | str = TransportKind.AUTO
    """NCCL (one GPU per rank), SHM (one host: NumPy, or ranks sharing GPUs) or AUTO (NCCL on
    a GPU backend, SHM on NumPy); or its text, 'nccl', 'shm' or 'auto'."""
    timeout_s: float = 120.0
    """How long a rank waits for another before failing with a RingError naming it."""
    placement: PlacementChoice = "cyclic"
    """How the ring deals its layers (dataflow.memplan.plan.ranks.PLACEMENTS): 'cyclic' (layer i
    on rank i mod ring_size), 'balanced' (the head's rank owns fewer layers: it also runs the
    head), 'contiguous', or 'auto': the one the layout chooser predicts fastest (with replicas
    None). A 'placement' in plan_options takes precedence."""
    split_fetch: bool = False
    """With replicas: each fetches 1/R of every streamed weight use from its host memory and
    gathers the rest from the other replicas over NVLink (RankPlan.split_fetch). Off by
    default: on 2 H200s at 60/24 it measured 2.5 % slower than each fetching everything (8b,
    16k chunks, copies already hidden; docs/ring.md)."""
    split_update: bool = False
    """With R >= 2 replicas (rings of any size; shared memory: NumPy, or CuPy; NCCL written, not
    yet run on two GPUs): each block's gradient is reduce-scattered over the replicas' ranks
    that hold it, each runs AdamW on its part alone (AdamW state for that part only) and the
    updated parts are gathered
    (RankPlan.split_update; the same bits as without over shared memory; docs/ring.md "Split
    updates"). Off by default; what is not built (MoE, checkpoints) is refused by name."""
    vocab_parallel_head: bool = False
    """Every rank of a ring of 2+ holds a shard of the head's vocabulary and computes the logits
    and loss over it, instead of the last layer's rank carrying the whole head
    (RankPlan.vocab_parallel, docs/ring.md; shared memory: NumPy, or CuPy ranks sharing a GPU;
    NCCL: checked for rendezvous deadlocks, not yet run on two GPUs; untied dense models)."""
    env: RankEnv | None = None
    """This process's place; default: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT (or SLURM_*) from the environment."""

    def engine(self, model, **options) -> "RingEngine":
        """What Engine(model, ..., ring=self) returns."""
        return RingEngine(self, model, **options)


def _whole(total: int, parts: int, what: str, by: str) -> int:
    if total % parts:
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
                 deferred_update: bool = True, precision: str = "bf16"):
        self.cfg = model if isinstance(model, ModelConfig) else model_config(model)
        self.env = ring.env or rank_env()
        transport = TransportKind.parse(ring.transport)
        opt = optimizer or AdamWConfig(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                       weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        options = dict(plan_options or {})
        if precision != "bf16":  # the rank plans' and their backends' (dataflow.precision)
            options["precision"] = precision
        if ring.vocab_parallel_head:  # every ring of 2+ ranks splits its head's vocabulary
            options["vocab_parallel"] = True
        if ring.placement != "auto":  # else choose_ring_layout weighs the placements
            options.setdefault("placement", ring.placement)
        if tokens_per_step is not None:
            seqs_per_step = _whole(tokens_per_step, seqlen, "tokens_per_step", "seqlen")
        replicas = ring.replicas
        if replicas is None:  # the planner's layout for this many processes
            # planned as the ranks will plan: their backend's profile, their transport's reserve
            kind = backend if backend != "auto" else process_backend()
            choice = choose_ring_layout(
                self.cfg, seqlen, host_gb, dev_gb, profile or launch_profile(kind),
                self.env.gpus, transport=transport.resolve(kind), constraints=options,
                seqs_per_step=seqs_per_step, split_fetch=ring.split_fetch,
                split_update=ring.split_update, single_tok_per_s=None)
            replicas = choice.chosen.layout.replicas
            options.update(choice.chosen.constraints)
        elif seqs_per_step is not None:  # the global batch: each replica plans its share
            options["seqs_per_step"] = _whole(seqs_per_step, replicas, "seqs_per_step",
                                              "replicas")
        self.rank, self.transport = open_rank(
            self.cfg, seqlen, host_gb, dev_gb, env=self.env, replicas=replicas,
            backend=backend, transport=transport, timeout_s=ring.timeout_s, seed=seed,
            optimizer=opt, lr_schedule=lr_schedule, grad_accum=GradAccum(grad_accum),
            profile=profile, deferred_update=deferred_update, split_fetch=ring.split_fetch,
            split_update=ring.split_update,
            **options)
        source = model_weights_dir(model)
        if source is not None:  # a Hugging Face or saved model brings its weights, as on one GPU
            self.rank.load_weights(source)
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
        gpus = self.env.gpus
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
                        extra: dict | None = None, keep: int | None = None,
                        force_dir: bool = False):
        """Save the whole ring's weights, AdamW m and v, step and schedule (and process 0's
        data / rng / extra) to `path/step_<step>`, as Engine.save_checkpoint does; every rank
        writes its own blocks. Collective; `path` must be one directory that every process
        sees. Returns the checkpoint's path on every process."""
        self._check_open()
        return save_ring_checkpoint(self.rank, self.transport, self.cfg, path, data=data,
                                    rng=rng, extra=extra, keep=keep, force_dir=force_dir)

    def load_checkpoint(self, path, *, verify: bool = True, allow_changes: bool = False):
        """Restore this rank's blocks, the step and the schedule from a checkpoint of the whole
        model (one device's or any ring's); as Engine.load_checkpoint, and if any process
        refuses the checkpoint (damaged file, other model or settings) none loads anything.
        Collective. Returns a dataflow.checkpoint.CheckpointInfo."""
        self._check_open()
        return load_ring_checkpoint(self.rank, self.transport, self.cfg, path, verify=verify,
                                    allow_changes=allow_changes)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this RingEngine is closed; create a new one")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.rank.close()

    def __enter__(self) -> "RingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
