"""A ring job: what every process of a `dataflow-ring` run is told (the model, budgets, steps, the
job's process count, transport and placement), its JSON for the spawned ranks, and the global
batches every rank and the single-device reference read. Counts: `gpus` is the job's processes
(every rank of every replica, `--gpus`, WORLD_SIZE); `ring_size` is the ranks of one ring,
gpus / replicas (memplan's RankPlan calls it n_ranks). Never plans, spawns or trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dataflow.batch import make_batch
from dataflow.data import token_stream
from dataflow.memplan.plan.plan import GradAccum
from dataflow.models.config import ModelConfig
from dataflow.models.hf_config import is_hf_dir
from dataflow.models.hf_config import model_config as resolve_model
from dataflow.models.serial import from_json
from dataflow.models.storage import is_model_dir
from dataflow.ring.kinds import Placement, TransportKind


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RingJob:
    model: str
    """Any model argument (dataflow.models.hf_config.model_config), or a ModelConfig as JSON (tests
    use small custom shapes)."""
    seqlen: int
    host_gb: float
    """Per-device budgets (GiB)."""
    dev_gb: float
    gpus: int
    """Processes in the job: `replicas` rings of gpus / replicas ranks each (`--gpus`)."""
    steps: int = 1
    seed: int = 0
    """Weight initialisation."""
    data: str = "shipped"
    """'shipped' (the shipped text's bytes, for byte models), 'random:<seed>' (uniform random
    ids, for tests) or 'text:<path>' (dataflow.data.open_data: a user's data, or the shipped text
    when the path is empty, tokenised with the model's own tokenizer as dataflow-demo does;
    data_options says how)."""
    data_options: tuple[tuple[str, object], ...] = ()
    """dataflow.data.open_data.DataOptions fields for 'text:' data."""
    lr: float = 1e-3
    max_grad_norm: float | None = 1.0
    grad_accum: GradAccum = GradAccum.BF16
    """Gradient accumulation across rounds (dataflow.memplan.plan.plan.GradAccum)."""
    precision: str = "bf16"
    """'bf16' or 'fp8' (dataflow.precision): the ranks' linear layers."""
    eager_update: bool = False
    """Run each step's AdamW at its own end (default: inside the next step's first round, and
    the last step's before the weights are written; the same bits either way)."""
    trace: bool = False
    """Each rank traces its backend's streams and reports every step's breakdown."""
    replicas: int = 1
    """Data-parallel rings: the job's processes form `replicas` rings of gpus / replicas
    ranks; each ring trains its slice of the global batch (replicas x seqs_per_step rows)."""
    split_fetch: bool = False
    """With replicas: each fetches 1/R of every streamed weight use and gathers the rest from
    the others (RankPlan.split_fetch); False: each fetches everything itself."""
    split_update: bool = False
    """With replicas: each block's gradient is reduce-scattered and each replica updates its
    part alone (RankPlan.split_update); False: every replica updates the whole model."""
    vocab_parallel_head: bool = False
    """Every rank of a ring of 2+ holds a shard of the head's vocabulary and computes the
    logits and loss over it (RankPlan.vocab_parallel; shared memory: NumPy, or CuPy ranks
    sharing a GPU)."""
    backend: str = "numpy"
    transport: TransportKind = TransportKind.SHM
    """SHM (one host: NumPy backend, or ranks sharing GPUs through pinned staging), NCCL (CuPy
    backend, one GPU per rank) or AUTO (each rank takes its backend's)."""
    timeout_s: float = 60.0
    out_dir: str = ""
    """Where rank r writes rank<r>.json (losses, step times) and rank<r>.npz ('' nothing)."""
    save_weights: bool = True
    """Write rank<r>.npz, the rank's blocks' final weights, beside rank<r>.json."""
    constraints: tuple[tuple[str, int], ...] = ()
    """Plan constraints (chunk_tokens, chunks_per_round, rounds_per_step) for every rank."""
    placement: Placement = "cyclic"
    """How the ring deals its layers: 'cyclic' (layer i on rank i mod ring_size), 'balanced'
    (the head's rank owns fewer layers) or 'contiguous'. A 'placement' among the constraints
    (a layout's choice) takes precedence."""
    eval_seqs: int = 0
    """After the last step, the forward-only loss (RingRank.evaluate) of this many sequences that
    no step of the run trained on (the next ids of a 'random:' stream, or the shipped text after
    the run's last batch), written as eval_loss beside the losses."""
    checkpoint_dir: str = ""
    """Where the ring saves checkpoints (step_NNNNNNNN/, dataflow.checkpoint's format: one
    device or a ring of another size can resume from them); one directory every rank sees."""
    save_every: int = 0
    """Save every this many steps and at the last step (0: never)."""
    keep: int = 3
    """Keep the newest this many checkpoints (0: all)."""
    force_checkpoint_dir: bool = False
    """Save into checkpoint_dir even though it holds other files (dataflow.checkpoint_dir)."""
    resume: bool = False
    """Start from the newest checkpoint in checkpoint_dir (from step 0 when there is none);
    `steps` is then the run's total, so a run resumed at step 3 of 6 trains 3 more."""
    fault: str = ""
    """Tests only: 'kill:<rank>:<step>' makes that rank SIGKILL itself before that step."""

    @property
    def ring_size(self) -> int:
        """Ranks of one ring: the job's processes divided among the replicas."""
        return self.gpus // self.replicas

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        raw.update(transport=self.transport.value, grad_accum=self.grad_accum.value)
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RingJob":
        raw = json.loads(text)
        raw["constraints"] = tuple(tuple(kv) for kv in raw.get("constraints", ()))
        raw["data_options"] = tuple(tuple(kv) for kv in raw.get("data_options", ()))
        raw["transport"] = TransportKind.parse(raw.get("transport", "shm"))
        raw["grad_accum"] = GradAccum(raw.get("grad_accum", "bf16"))
        return cls(**raw)


def model_config(spec: str) -> ModelConfig:
    """A ModelConfig's JSON, or any model argument the other commands take (a zoo name, a saved
    model or checkpoint step directory, a config JSON, a Hugging Face directory: one resolution,
    dataflow.models.hf_config.model_config)."""
    if spec.lstrip().startswith("{"):
        return from_json(ModelConfig, spec)
    return resolve_model(spec)


def model_weights_dir(model) -> Path | None:
    """The directory whose weights a ring on `model` starts from (a Hugging Face directory or
    a saved dataflow model, as the Engine loads them), else None (a zoo name or a config file:
    the seeded initialisation)."""
    if not isinstance(model, (str, Path)) or str(model).lstrip().startswith("{"):
        return None  # an inline JSON config (RingJob.model as ring workers get it) names no path
    path = Path(model)
    try:
        is_dir = path.is_dir()
    except OSError:  # a name no file system takes (too long); not a directory
        return None
    return path if is_dir and (is_hf_dir(path) or is_model_dir(path)) else None


def batches(job: RingJob, cfg, seqs_per_step: int, start: int = 0):
    """The global batch of each step from step `start` (0-based) to job.steps, the same on
    every rank and in the single-device run (a resumed run continues where the saved one was)."""
    if job.data.startswith("random:"):
        stream = _random_rows(job, cfg)
        for step in range(job.steps):
            batch = stream(seqs_per_step)
            if step >= start:
                yield batch
        return
    if job.data.startswith(TEXT):
        source = open_job_data(job, cfg)
        for step in range(job.steps):  # the position of step `start`: the steps before it read
            batch = step_batch(source.next_batch(seqs_per_step), cfg, job.seqlen)
            if step >= start:
                yield batch
        return
    for step in range(start, job.steps):
        yield token_stream(job.seqlen, seqs_per_step, cfg.vocab_size,
                           start=step * seqs_per_step * job.seqlen)


def eval_batch(job: RingJob, cfg, seqs_per_step: int):
    """The job's eval_seqs rows of seqlen + 1 ids that follow its training batches."""
    if job.data.startswith("random:"):
        stream = _random_rows(job, cfg)
        for _ in range(job.steps):
            stream(seqs_per_step)
        return stream(job.eval_seqs)
    if job.data.startswith(TEXT):  # the held-out tail, never trained on
        return open_job_data(job, cfg).eval_batch(job.eval_seqs)
    return token_stream(job.seqlen, job.eval_seqs, cfg.vocab_size,
                        start=job.steps * seqs_per_step * job.seqlen)


TEXT = "text:"


def open_job_data(job: RingJob, cfg):
    """The source of a 'text:' job (its corpus cached by the launcher, so a rank only reads)."""
    # the data path: only for a job that reads a user's data
    from dataflow.data.open_data import DataOptions, open_data

    path = job.data[len(TEXT):] or None
    return open_data(path, job.seqlen, cfg.vocab_size, model=job.model,
                     options=DataOptions(**dict(job.data_options)), eval_seqs=job.eval_seqs,
                     progress=False)


def step_batch(rows, cfg, seqlen: int, *, pad_rows_to: int = 1):
    """A source's rows (token ids, or a TokenBatch with labels and doc ids) as a Batch."""
    if hasattr(rows, "labels"):
        return make_batch(rows.tokens, rows.labels, doc_ids=rows.doc_ids,
                          vocab_size=cfg.vocab_size, seqlen=seqlen, pad_rows_to=pad_rows_to)
    return make_batch(rows, vocab_size=cfg.vocab_size, seqlen=seqlen, pad_rows_to=pad_rows_to)


def _random_rows(job: RingJob, cfg):
    """rows -> the next (rows, seqlen + 1) uniform random ids of a 'random:<seed>' job."""
    rng = np.random.default_rng(int(job.data.split(":", 1)[1]))
    return lambda rows: rng.integers(0, cfg.vocab_size, (rows, job.seqlen + 1), dtype=np.int32)
