"""The Engine: the API other trainers embed. Builds (or takes) a Plan, allocates the arenas once,
initialises or loads the weights into their homes, and trains one step per call. Owns the
hyperparameters and the step counter; the executor owns the schedule. Never decides placement."""

from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from dataflow.backend import Backend, Place
from dataflow.backends import make_backend
from dataflow.batch import make_batch
from dataflow.block_io import init_weights, read_part, write_part, zero_state
from dataflow.engine_options import (RunOptions, check_option_names, checkpoint_dir, join_pieces,
                                     with_checkpoint_defaults)
from dataflow.executor import Executor
from dataflow.instrument import StepBreakdown, TracingBackend
from dataflow.optimizer import AdamW, AdamWConfig
from dataflow.memplan.search.cost import workload_of
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.models.config import ModelConfig
from dataflow.models.hf import is_hf_dir, model_config
from dataflow.models.errors import ConfigError, NonFiniteError, StepFailedError
from dataflow.models.flops import flop_model_version, model_flops_per_seq
from dataflow.models.layout import BlockKind


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    step: int
    loss: float
    """Mean cross-entropy over the step's counted targets (labels other than -100), as
    transformers computes it."""
    round_losses: tuple[float, ...]
    tokens: int
    """Tokens processed (seqs_per_step * seqlen): the numerator of tok/s."""
    step_time_s: float
    tok_per_s: float
    model_tflop_per_s: float
    mfu: float
    hfu: float
    flop_model_version: str
    h2d_bytes: int
    d2h_bytes: int
    lr: float
    grad_norm: float | None
    """Global L2 norm of the step's gradients before clipping (every training step)."""
    breakdown: StepBreakdown | None = None
    """Where the step's time and bytes went; None unless the engine traces (trace=True)."""
    loss_tokens: int | None = None
    """Targets counted in the loss (not -100); the loss is their mean."""
    aux_loss: float | None = None
    """MoE models (ModelConfig.moe): the router's load-balancing loss, unscaled by
    router_aux_loss_coef: each round is one forward (transformers' micro-batch) with its own,
    and this is their mean over the step's rounds; the objective trained is loss +
    router_aux_loss_coef * aux_loss (+ router_z_loss_coef * z_loss). None when dense."""
    z_loss: float | None = None
    """MoE models: the router z-loss (mean logsumexp^2 over a round's rows), the mean over the
    step's rounds, unscaled; None when dense."""

    def to_dict(self) -> dict:
        """The result as plain JSON types (str, int, float, None, lists, dicts): every field by
        name, breakdown as a nested dict (or None), for json.dumps, a TensorBoard or W&B log."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRef:
    """One block of the model: the embedding, layer `layer`, or the head (final norm + lm_head;
    the norm alone when the head is tied to the embedding, ModelConfig.tie_embeddings).
    Weights, AdamW m and v of a block share its layout (`Engine.layout(ref)`)."""

    kind: BlockKind
    layer: int | None = None

    @property
    def name(self) -> str:
        return f"layers.{self.layer}" if self.kind is BlockKind.LAYER else self.kind.value


CONFIGURED = object()
"""train_step's max_grad_norm default: the clipping the engine was built with."""

BLOCK_PARTS = ("weights", "m", "v")
"""The parts of a block that persist across steps (gradients are cleared by every step)."""

_FROM_CHECKPOINT = object()
"""weights= of an engine built on a checkpoint: leave the blocks for load_checkpoint to write."""


def _serialised(method):
    """A public call: refused by name once the engine is closed, and run under the engine's lock,
    so calls from several threads take turns instead of interleaving their work (reentrant: a
    public call may make others, as save_checkpoint reads blocks)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            self._check_open(name)
            return method(self, *args, **kwargs)

    return call


class Engine:
    """Train a model under host and device memory budgets.

    >>> with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=128, backend="numpy") as eng:
    ...     result = eng.train_step(batch)   # batch: (eng.seqs_per_step, 129) token ids

    Thread model: an Engine may be shared by threads. Its public calls (train_step, eval_step,
    state_dict, load_state_dict, weights, read_block, write_block, save_checkpoint,
    load_checkpoint, save_pretrained, set_lr, memory_used_bytes, close) are serialised by one
    lock: a call made while another thread's call runs waits for it, so an eval_step from a
    background thread runs between two train_steps, never inside one. The order in which
    waiting threads get the lock is not defined; a trainer that needs an order (step 2 after
    step 1) orders its own threads. step_progress and the read-only properties (lr, step,
    seqs_per_step) take no lock, so another thread can watch a long step. After close() every
    public call raises ConfigError naming the call.
    """

    def __new__(cls, *args, ring=None, **kwargs):
        if ring is not None:  # the ring builds this process's rank (dataflow.ring.engine.RingEngine)
            return ring.engine(*args, **kwargs)
        # Python names only the keyword; this also names the closest one the Engine takes
        check_option_names(kwargs, _init_keywords(), "Engine()")
        return super().__new__(cls)

    def __init__(self, model: str | Path | ModelConfig, *, host_gb: float, dev_gb: float,
                 seqlen: int, seqs_per_step: int | None = None,
                 tokens_per_step: int | None = None, backend: str | Backend = "auto",
                 seed: int = 0, weights=None, lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                 optimizer: AdamWConfig | None = None,
                 lr_schedule: Callable[[int], float] | None = None, profile=None,
                 plan_options: dict | None = None, trace: bool = False, progress=None,
                 schedule=None, deferred_update: bool = True, backward_update: bool = False,
                 sanitize: bool = False, sanitize_seed: int = 0, ring=None):
        """Plan `model` at `seqlen` under the budgets, then start it.

        model: a zoo name ('tiny', '1b', '8b', ...), a config JSON, a saved model directory or a
            Hugging Face Llama directory (its weights are loaded), or a checkpoint directory
            written by save_checkpoint (a `step_*` directory, or a root: its newest): the
            engine then resumes it, loading its weights, AdamW m and v, step count and lr
            schedule; optimizer settings left at their defaults take the checkpoint's.
        host_gb, dev_gb: the host and device memory budgets in GiB (2^30 bytes).
        seqlen: tokens per sequence (a batch row holds seqlen + 1 ids).
        seqs_per_step / tokens_per_step (a multiple of seqlen): the global batch of one
            optimizer step, which the planner keeps, choosing chunks and rounds under the
            budgets (InfeasibleBudget names the smallest budgets for it); default: the
            planner's choice (read it as eng.seqs_per_step).
        backend: 'auto' (CuPy when a GPU is usable, else NumPy), 'numpy', 'cupy', or a Backend.
        seed: the initialisation's seed (unused when weights are loaded).
        weights: a dataflow.models.init.ModelWeights, or a saved model directory to load.
        lr: the peak learning rate (default 3e-4) when there is no lr_schedule; a step's own
            lr= and set_lr() override it.
        betas, eps, weight_decay: AdamW's (default (0.9, 0.95), 1e-8, 0.0).
        max_grad_norm: clip the global gradient norm to this value (default 1.0, as
            dataflow-demo's --max-grad-norm); 0 or None: no clipping.
        optimizer: a whole dataflow.optimizer.AdamWConfig instead of lr ... max_grad_norm.
        lr_schedule: step (1-based) -> lr, e.g. dataflow.lr_schedule.WarmupCosine.
        profile: the planner's hardware profile (default: this backend's, see default_profile).
        plan_options: further keywords of dataflow.memplan.make_plan.
        trace: wrap the backend in a TracingBackend, so every StepResult carries its breakdown
            and `last_trace` the step's spans.
        progress: anything with update(), called once per block initialised or loaded.
        schedule: a compiled dataflow.memplan.step.compile.Schedule to run instead of the plan's.
        deferred_update: (default True) a step's AdamW runs inside the next step's first
            round, hidden behind its compute, or before anything reads, saves or evaluates the
            model; the same bits as False, which updates at the end of each step.
        backward_update: (default False) a step runs its AdamW inside its own last round, each
            streamed layer's right after its gradient is final; the same bits again, but it
            cannot clip (pass max_grad_norm=0), and a step that raises NonFiniteError has then
            already updated the weights, as with deferred_update=False.
        sanitize, sanitize_seed: run the NumPy backend under the schedule sanitizer.
        ring: a dataflow.ring.engine.Ring, to train as one process of a ring launched by
            torchrun, srun or dataflow-ring: the budgets are per device, and the constructor
            returns that ring's RingEngine for this process (see docs/ring.md).

        A misspelt keyword raises UnknownOptionError (a TypeError and a ConfigError) naming
        the closest valid one."""
        from dataflow.memplan import make_plan

        options = RunOptions(
            backend=backend, seed=seed, weights=weights, lr=lr, betas=betas, eps=eps,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm, optimizer=optimizer,
            lr_schedule=lr_schedule, sanitize=sanitize, sanitize_seed=sanitize_seed,
            trace=trace, progress=progress, schedule=schedule,
            deferred_update=deferred_update, backward_update=backward_update)
        resume = checkpoint_dir(model)
        if resume is not None:
            cfg, options = _checkpoint_options(resume, options)
        else:
            if not isinstance(model, ModelConfig) and is_hf_dir(model) and weights is None:
                options = dataclasses.replace(options, weights=model)  # HF brings its weights
            cfg = model if isinstance(model, ModelConfig) else model_config(model)
        options.check()
        refuse_moe_backend(cfg, options.backend)  # a caller's own backend, before the plan
        t0 = time.perf_counter()
        be = _backend(options)
        t1 = time.perf_counter()
        plan_kw = dict(plan_options or {})
        for key, value in (("seqs_per_step", seqs_per_step), ("tokens_per_step", tokens_per_step)):
            if value is not None:
                plan_kw[key] = value
        plan = make_plan(cfg, seqlen, Budget.from_gib(host_gb, dev_gb),
                         profile or default_profile(be), **plan_kw)
        t2 = time.perf_counter()
        self._start(plan, be, options)
        if resume is not None:
            try:  # the settings the caller passed are deliberate changes of the checkpoint's
                self.load_checkpoint(resume, allow_changes=True)
            except BaseException:
                self.close()  # its blocks were never written: no half-built engine is left
                raise
        self.setup_seconds = {"backend": t1 - t0, "plan": t2 - t1, **self.setup_seconds}

    @classmethod
    def from_plan(cls, plan: Plan, **options) -> "Engine":
        """Start a plan you made or edited. options: the keywords of Engine() from backend on
        (backend, seed, weights, lr, betas, eps, weight_decay, max_grad_norm, optimizer,
        lr_schedule, trace, progress, schedule, deferred_update, backward_update, sanitize,
        sanitize_seed), with the same defaults and meaning; a misspelt one raises
        UnknownOptionError naming the closest."""
        run = RunOptions.from_keywords(options, "Engine.from_plan()")
        if not (plan.holds_embed and plan.holds_head):
            raise ConfigError(f"this plan of {plan.model.name} is one ring rank's (it holds "
                              f"{'no embedding' if not plan.holds_embed else 'the embedding'} "
                              f"and {'no head' if not plan.holds_head else 'the head'}); train "
                              "it as a ring (Engine(..., ring=dataflow.ring.engine.Ring()), dataflow-ring) "
                              "or plan one device with make_plan")
        run.check()
        self = cls.__new__(cls)
        self._start(plan, _backend(run), run)
        return self

    def _start(self, plan, be, options: RunOptions) -> None:
        refuse_moe_backend(plan.model, be)
        self._lock = threading.RLock()
        self._closed = True  # until setup completes
        self._deferred_update = options.deferred_update
        self._backward_update = options.backward_update
        self._setup(plan, TracingBackend(be) if options.trace else be, options.seed,
                    options.weights, options.adamw(), options.lr_schedule, options.progress,
                    options.schedule)

    def _setup(self, plan, be, seed, weights, opt_cfg, lr_schedule, progress, schedule) -> None:
        from dataflow.warmup import start_host_compile

        # numba compiles the plan's host kernels (seconds each, cold) in another process while
        # this one pins, clears and initialises; warm_up then loads them from numba's cache
        background = start_host_compile(plan)
        try:
            self._setup_parts(plan, be, seed, weights, opt_cfg, lr_schedule, progress, schedule,
                              background)
        except BaseException:
            if background is not None:
                background.kill()
                background.wait()
            raise

    def _setup_parts(self, plan, be, seed, weights, opt_cfg, lr_schedule, progress, schedule,
                     background) -> None:
        self.plan, self.be = plan, be
        # The hardware FLOPs a round adds beyond the model's (recompute by level, attention
        # score recompute, segment re-runs, K/V re-forming), as the prediction counts them, so
        # HFU compares with it; fixed by the plan, so counted once, not every step.
        self._round_extra_flops = workload_of(plan, plan.profile).extra_flops
        self.last_trace = None
        self._progress = progress
        from dataflow.warmup import start_prebuild

        clock = _PhaseClock()
        # CUDA modules and cuDNN graphs are built in a thread while the executor pins the host
        # slab (host work both; pinning 120 GiB takes 10-30 s); warm_up then finds them built
        prebuild = start_prebuild(plan, be)
        try:
            self.ex = Executor(plan, be, schedule, deferred_update=self._deferred_update,
                               backward_update=self._backward_update)
        finally:
            self.prebuild_parts = prebuild.join() if prebuild is not None else {}
            """What the setup-time build in a thread took (seconds per part, and total)."""
        clock.lap("executor")  # schedule, both arenas (pinning the host slab), library scratch
        self._optimizer = AdamW(opt_cfg, lr_schedule)
        self._zero_state()
        clock.lap("zero_state")
        if weights is _FROM_CHECKPOINT:
            pass  # the constructor's load_checkpoint writes every block next
        elif weights is None:
            self._init_weights(seed)
            clock.lap("init_weights")
        else:
            if isinstance(weights, (str, Path)):
                from dataflow.models.hf import open_weights

                weights = open_weights(weights)  # a model directory or a Hugging Face one
            self._load_weights(weights)
            clock.lap("load_weights")
        self.be.synchronize()
        clock.lap("synchronize")
        self.be.seal()  # from here on every device byte comes from the arenas
        from dataflow.warmup import warm_up

        # what step 1 would build on first use (CUDA modules, cuDNN graphs, numba kernels),
        # built now, after the seal, so the guard sees any allocation it might make
        self.warm_up_parts = warm_up(plan, be, self.ex.schedule, background)
        """warm_up's own breakdown: seconds per part (host_kernels, and on the GPU cuda_modules,
        attention_graphs) and, on the GPU, attention_graphs_built / _from_cache (counts)."""
        clock.lap("warm_up")
        self.setup_seconds = clock.laps
        """Wall seconds of each setup phase (constructor also: backend, plan), in order."""
        self._closed = False

    # -- state ------------------------------------------------------------------------------
    def _zero_state(self) -> None:
        """Zero gradients and AdamW m, v wherever they live (dataflow.block_io.zero_state: host
        memory in parallel, pages that already read as zero left unwritten, so a fresh slab is
        neither written nor faulted in for nothing)."""
        self.be.synchronize()  # once: nothing is queued that touches this state yet
        for b in self.ex.blocks():
            zero_state(self.be, b)

    def _targets(self):
        """(key, block kind, layer, Block) for every block, in model order."""
        return [(b.key, b.kind, b.layer, b) for b in self.ex.blocks()]

    def _write_block(self, b, array: np.ndarray, part: str = "weights") -> None:
        write_part(self.ex, self.be, b, array, part)

    def _init_weights(self, seed: int) -> None:
        """Initialise each block straight into where it lives (dataflow.block_io.init_weights:
        home, else the device when it is host memory, else the pinned io staging and one H2D
        copy). No block passes through a temporary; copies from home are asynchronous and
        _setup synchronises once at the end."""
        from dataflow.models import init

        cfg = self.plan.model
        fill = {BlockKind.EMBED: lambda layer, out: init.init_embed_block(cfg, seed, out=out),
                BlockKind.LAYER: lambda layer, out: init.init_layer_block(cfg, layer, seed,
                                                                          out=out),
                BlockKind.HEAD: lambda layer, out: init.init_head_block(cfg, seed, out=out)}
        for key, kind, layer, b in self._targets():
            init_weights(self.ex, self.be, b, functools.partial(fill[kind], layer))
            if self._progress is not None:
                self._progress.update()

    def _load_weights(self, weights) -> None:
        if weights.cfg != self.plan.model:
            raise ConfigError(f"weights are for model '{weights.cfg.name}' but the plan is for "
                              f"'{self.plan.model.name}'; load matching weights")
        blocks = (blk[3] for blk in weights.blocks())  # lazy: HFWeights reads block by block
        for (key, kind, layer, b), block in zip(self._targets(), blocks):
            self._write_block(b, block)
            if self._progress is not None:
                self._progress.update()

    def _settle(self) -> None:
        """Apply a deferred AdamW still pending, so reads, writes and evaluations see the model
        after the last step (a failed step's update is dropped instead: see train_step)."""
        if self.ex.update_pending:
            if getattr(self, "_failed_step", None) is not None:
                self.ex.drop_pending()
            else:
                self.ex.flush()

    def _read_block(self, b, part: str) -> np.ndarray:
        self._settle()
        return read_part(self.ex, self.be, b, part)

    @_serialised
    def weights(self):
        """The current parameters as a dataflow.models.init.ModelWeights (host copies)."""
        from dataflow.models.init import ModelWeights

        blocks = {key: self._read_block(b, "weights") for key, _, _, b in self._targets()}
        cfg = self.plan.model
        return ModelWeights(cfg, blocks["embed"],
                            [blocks[f"layer{i}"] for i in range(cfg.n_layers)], blocks["head"])

    @_serialised
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters under transformers' names and shapes, plus AdamW state as
        'optimizer.<name>.exp_avg' / '.exp_avg_sq' and 'optimizer.step'."""
        out: dict[str, np.ndarray] = {}
        for key, kind, layer, b in self._targets():
            lay = self._layout(kind)
            parts = {"": self._read_block(b, "weights"), ".exp_avg": self._read_block(b, "m"),
                     ".exp_avg_sq": self._read_block(b, "v")}
            for t in lay.tensors:
                name = lay.full_name(t.name, layer)
                for suffix, block in parts.items():
                    prefix = "optimizer." if suffix else ""
                    out[prefix + name + suffix] = lay.view(block, t.name).copy()
        out["optimizer.step"] = np.array(self.optimizer.step_count, dtype=np.int64)
        return out

    @_serialised
    def load_state_dict(self, state: dict, *, weights_only: bool = False) -> None:
        """Inverse of state_dict. Every key, shape and dtype is checked before anything is
        written, so a bad state leaves the engine as it was; the error lists each problem with
        the tensor's name and the fix. Tensors may be any float dtype or bf16 (bf16 saved by
        np.savez comes back as raw 2-byte void '|V2' and is read as ml_dtypes.bfloat16).
        weights_only: load the parameters alone (e.g. weights from another trainer): AdamW
        state is zeroed and the step count restarts at 0; 'optimizer.*' keys are ignored.
        Loading also clears gradients and lets an engine whose step failed train again."""
        import ml_dtypes

        bf16 = np.dtype(ml_dtypes.bfloat16)
        parts = (("", "weights"),) if weights_only else \
            (("", "weights"), (".exp_avg", "m"), (".exp_avg_sq", "v"))
        problems: list[str] = []
        writes = []  # (block dict, part, layout, {tensor name: array}) once all are valid
        expected = {"optimizer.step"}
        for key, kind, layer, b in self._targets():
            lay = self._layout(kind)
            for suffix, part in parts:
                arrays = {}
                for t in lay.tensors:
                    name = ("optimizer." if suffix else "") + lay.full_name(t.name, layer) + suffix
                    expected.add(name)
                    value, problem = _checked_tensor(state, name, t.shape, bf16)
                    if problem:
                        problems.append(problem)
                    else:
                        arrays[t.name] = value
                writes.append((b, part, lay, arrays))
        unknown = sorted(k for k in state if k not in expected
                         and not (weights_only and str(k).startswith("optimizer.")))
        if unknown:
            problems.append(f"unknown key(s) {', '.join(repr(k) for k in unknown[:5])}"
                            f"{' ...' if len(unknown) > 5 else ''} (a state_dict of another "
                            "model? drop them)")
        step = 0
        if not weights_only and "optimizer.step" in state:
            raw = np.asarray(state["optimizer.step"])
            if raw.ndim != 0 or raw.dtype.kind not in "iu" or int(raw) < 0:
                problems.append(f"'optimizer.step' is {state['optimizer.step']!r}; it must be a "
                                "whole number >= 0 (or load with weights_only=True)")
            else:
                step = int(raw)
        if problems:
            raise ConfigError(f"state_dict does not fit {self.plan.model.name} "
                              f"({len(problems)} problem(s), nothing was loaded): "
                              + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
        self.ex.drop_pending()  # every block it would update is overwritten or zeroed
        self._zero_state()  # grads (half-accumulated after a failed step), m and v
        for b, part, lay, arrays in writes:
            block = np.zeros(lay.numel, dtype=bf16)
            for tensor, value in arrays.items():
                lay.view(block, tensor)[...] = value
            self._write_block(b, block, part)
        self.optimizer.step_count = step
        self.optimizer.last_grad_norm = None
        self._failed_step = None
        self.be.synchronize()

    # -- block access (stable API for checkpoints and interop) ------------------------------
    @_serialised
    def block_refs(self) -> tuple[BlockRef, ...]:
        """Every block in model order: embed, layers 0..L-1, head."""
        return tuple(BlockRef(kind, layer) for _, kind, layer, _ in self._targets())

    @_serialised
    def layout(self, ref: BlockRef):
        """The block's layout (tensors with transformers' names and shapes, numel, views)."""
        return self._layout(ref.kind)

    def _target(self, ref: BlockRef):
        ex = self.ex
        return ex.layers[ref.layer] if ref.kind is BlockKind.LAYER else \
            ex.embed if ref.kind is BlockKind.EMBED else ex.head

    @_serialised
    def read_block(self, ref: BlockRef, part: str = "weights") -> np.ndarray:
        """A host copy of one block's weights, AdamW m or v (synchronous; one block at a time,
        so saving a large model never holds more than a block beside the arenas)."""
        if part not in BLOCK_PARTS:
            raise ConfigError(f"block part '{part}' is not one of {', '.join(BLOCK_PARTS)}")
        return self._read_block(self._target(ref), part)

    @_serialised
    def write_block(self, ref: BlockRef, array: np.ndarray, part: str = "weights") -> None:
        """Overwrite one block's weights, AdamW m or v with `array` (numel elements, bf16)."""
        if part not in BLOCK_PARTS:
            raise ConfigError(f"block part '{part}' is not one of {', '.join(BLOCK_PARTS)}")
        self._settle()  # else the pending update would land on top of the written bytes
        self._write_block(self._target(ref), array, part)
        self.be.synchronize()

    def _layout(self, kind):
        ex = self.ex
        return {BlockKind.EMBED: ex.embed, BlockKind.LAYER: ex.layers[0],
                BlockKind.HEAD: ex.head}[kind].layout

    # -- training ---------------------------------------------------------------------------
    @property
    def seqs_per_step(self) -> int:
        return self.plan.chunking.seqs_per_step

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed engine counts the checkpoint's); the next
        train_step is step + 1. Read-only."""
        return self._optimizer.step_count

    @property
    def lr(self) -> float:
        """The lr the next train_step uses unless it passes lr=: the schedule's for step + 1,
        else set_lr's or the constructor's. Read-only (use set_lr); the lr a step used is its
        StepResult.lr."""
        opt = self._optimizer
        return opt.schedule(opt.step_count + 1) if opt.schedule else opt.config.lr

    @property
    def optimizer(self) -> AdamW:
        """The AdamW driver: its config (AdamWConfig), schedule and step_count. Read-only: set
        the lr with set_lr or train_step(..., lr=)."""
        return self._optimizer

    @_serialised
    def train_step(self, tokens, labels=None, *, doc_ids=None, position_ids=None,
                   lr: float | None = None, max_grad_norm=CONFIGURED) -> StepResult:
        """One optimizer step on the trainer's batch.

        tokens: (seqs_per_step, seqlen + 1) int ids (NumPy, or anything with __array__ or
        __dlpack__); inputs are tokens[:, :-1]. Or the batch in pieces: a list, tuple or
        iterator of 2-D blocks of whole sequences (n_i, seqlen + 1) whose rows add up to
        seqs_per_step, in order (e.g. one round's sequences at a time); the step is the same
        bits as passing them joined. labels, doc_ids and position_ids may come in pieces too. labels: the same shape, shifted inside as
        transformers does (the target of input j is labels[:, j + 1]); -100 counts nothing, and
        the loss is the mean over the counted targets. Default: the next tokens. doc_ids or
        position_ids (the same shape): packed documents; attention never crosses a document
        start and RoPE positions restart (see dataflow.batch). lr: this step's learning rate
        (default: the schedule, else set_lr's / the constructor's). max_grad_norm: clip this
        step's global gradient norm (0 or None: no clipping; default: the constructor's). The
        result's grad_norm (before clipping) is reported on every step: it is computed on the
        device with no host sync.

        Raises dataflow.models.errors.NonFiniteError when the step's loss or gradient norm is NaN or
        infinite. After that, or after any exception or interrupt inside the step, the engine
        refuses further steps (StepFailedError) until load_state_dict reloads a state: the
        step may have left gradients half-accumulated or the AdamW update half-applied.

        With deferred_update (the default) this step's AdamW runs inside the next step's first
        round, or as soon as the model is read, written, saved or evaluated; step_time_s then
        holds the previous step's update, not this one's. The update of a step that raised
        NonFiniteError is dropped, so the weights stay those before it."""
        self._check_usable()
        ch, cfg = self.plan.chunking, self.plan.model
        rows, seqlen = ch.seqs_per_step, ch.seqlen
        tokens, labels, doc_ids, position_ids = (
            join_pieces(value, name, rows, seqlen) for name, value in
            (("tokens", tokens), ("labels", labels), ("doc_ids", doc_ids),
             ("position_ids", position_ids)))
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=cfg.vocab_size, rows=rows, seqlen=seqlen)
        if batch.counted == 0:
            raise ConfigError("every label of the batch is -100, so the step has no target to "
                              "learn from; keep at least one label, or skip the batch")
        opt = self.optimizer
        step = opt.step_count + 1
        if lr is None:
            lr = opt.schedule(step) if opt.schedule else opt.config.lr
        clip = opt.config.max_grad_norm if max_grad_norm is CONFIGURED else max_grad_norm
        # Validates lr and clip (AdamWConfig's checks) before anything runs.
        call_config = dataclasses.replace(opt.config, lr=lr, max_grad_norm=clip)
        tracer = self.be if isinstance(self.be, TracingBackend) else None
        if tracer is not None:
            tracer.begin_step(step)
        saved = opt.config, opt.schedule
        opt.config, opt.schedule, opt.last_grad_norm = call_config, None, None
        try:
            stats = self.ex.step(batch, opt)
            opt.last_grad_norm = stats.grad_norm
        except BaseException as exc:  # KeyboardInterrupt too: the step stopped part way
            self._failed_step = (step, "interrupted" if isinstance(exc, KeyboardInterrupt)
                                 else f"{type(exc).__name__}: {exc}")
            self.ex.drop_pending()
            self.last_trace = None
            if tracer is not None:
                try:
                    tracer.end_step()  # close the window so a reloaded engine can trace again
                except Exception:  # noqa: BLE001 - the step's own error is the one to report
                    pass
            raise
        finally:
            opt.config, opt.schedule = saved
        self.last_trace = tracer.end_step() if tracer is not None else None
        result = self._result(stats, lr, batch.counted)
        for what, value in (("loss", result.loss), ("grad norm", result.grad_norm)):
            if value is not None and not np.isfinite(value):
                self._failed_step = (step, f"{what} {value}")
                self.ex.drop_pending()  # deferred: the blown-up update never lands
                raise NonFiniteError(
                    f"{what} became {_nonfinite_name(value)} at step {step} (lr {lr:g}); lower "
                    "the learning rate or clip gradients (max_grad_norm), then reload a state "
                    "saved before the blow-up (load_state_dict)",
                    step=step, lr=lr, what=what, value=float(value), result=result)
        return result

    @_serialised
    def eval_step(self, tokens, labels=None, *, doc_ids=None, position_ids=None) -> float:
        """The mean loss over the counted targets of `tokens` (any number of rows of
        seqlen + 1 ids, up to 512 rounds; same labels / doc_ids / position_ids conventions as
        train_step), forward only: no gradient is kept, no weight, AdamW state or step count
        changes (bit-identical before and after), so it may run between any two train_steps."""
        self._check_usable()
        ch, cfg = self.plan.chunking, self.plan.model
        batch = make_batch(tokens, labels, doc_ids=doc_ids, position_ids=position_ids,
                           vocab_size=cfg.vocab_size, seqlen=ch.seqlen,
                           pad_rows_to=ch.seqs_per_round)
        if batch.counted == 0:
            raise ConfigError("every label of the evaluation batch is -100; keep at least one")
        self._settle()
        return self.ex.evaluate(batch).loss

    def step_progress(self):
        """How far the train_step or evaluate in flight has got (dataflow.executor.StepProgress:
        events dispatched of the schedule's, the last one's name), None between steps. Safe to
        call from another thread: a long step (8b at 524k tokens takes over 13 minutes) can
        report progress while it runs, as dataflow-demo does every 30 s. Takes no lock."""
        self._check_open("step_progress")
        return self.ex.progress()

    @_serialised
    def set_lr(self, lr: float) -> None:
        """Use `lr` for every later step (replaces the lr schedule, if any); a train_step's own
        lr= still wins for that step."""
        self.optimizer.config = dataclasses.replace(self.optimizer.config, lr=lr)
        self.optimizer.schedule = None

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ConfigError(f"Engine is closed: {call} cannot run, because close() released "
                              "the engine's memory; create a new Engine (pass a checkpoint "
                              "directory as its model to continue a saved run)")

    def _check_usable(self) -> None:
        failed = getattr(self, "_failed_step", None)
        if failed is not None:
            step, reason = failed
            raise StepFailedError(
                f"step {step} failed ({reason}), so gradients and AdamW state may be half-"
                "updated; reload a saved state with load_state_dict(state) (or weights only "
                "with weights_only=True), or create a new Engine", step=step, reason=reason)

    def _result(self, stats, lr: float, loss_tokens: int) -> StepResult:
        plan, cfg, ch = self.plan, self.plan.model, self.plan.chunking
        model_flops = model_flops_per_seq(cfg, ch.seqlen) * ch.seqs_per_step
        hw_flops = model_flops + self._round_extra_flops * ch.rounds_per_step
        t = max(stats.step_time_s, 1e-12)
        peak = plan.profile.peak_bf16_flop_per_s
        return StepResult(
            step=self.optimizer.step_count, loss=stats.loss,
            round_losses=tuple(r.loss_sum / max(r.tokens, 1) for r in stats.rounds),
            tokens=stats.tokens, step_time_s=stats.step_time_s, tok_per_s=stats.tokens / t,
            model_tflop_per_s=model_flops / t / 1e12, mfu=model_flops / t / peak,
            hfu=hw_flops / t / peak, flop_model_version=flop_model_version(cfg),
            h2d_bytes=stats.h2d_bytes, d2h_bytes=stats.d2h_bytes, lr=lr,
            grad_norm=self.optimizer.last_grad_norm,
            breakdown=self.last_trace.breakdown() if self.last_trace is not None else None,
            loss_tokens=loss_tokens, aux_loss=stats.aux_loss, z_loss=stats.z_loss)

    @_serialised
    def memory_used_bytes(self) -> dict[str, int]:
        """Arena bytes per place (the budgets) and the bytes the plan's regions occupy."""
        return {"device_arena": self.be.memory_used_bytes(Place.DEVICE),
                "host_arena": self.be.memory_used_bytes(Place.HOST),
                "device_regions": self.ex.dev.used_bytes, "host_regions": self.ex.host.used_bytes}

    # -- checkpoints and Hugging Face export (dataflow.checkpoint, dataflow.models.hf) -----------------
    @_serialised
    def save_checkpoint(self, path, *, data: dict | None = None, rng=None,
                        extra: dict | None = None, keep: int | None = None):
        """Save weights, AdamW m and v, step, schedule and the caller's data position, RNG
        state and `extra` to `path/step_<step>` (atomic, one block in host memory at a time);
        keep: afterwards delete all but the newest `keep`. Returns the checkpoint's path."""
        from dataflow.checkpoint import save_checkpoint

        return save_checkpoint(self, path, data=data, rng=rng, extra=extra, keep=keep)

    @_serialised
    def load_checkpoint(self, path, *, verify: bool = True, allow_changes: bool = False):
        """Restore from a checkpoint directory (or the newest under a root); any plan of the
        same model loads it. Returns a dataflow.checkpoint.CheckpointInfo (step, data, rng)."""
        from dataflow.checkpoint import load_checkpoint

        return load_checkpoint(self, path, verify=verify, allow_changes=allow_changes)

    @_serialised
    def save_pretrained(self, path, *, overwrite: bool = False):
        """Write the weights as a Hugging Face Llama directory in bf16 (config.json and
        safetensors), one block in host memory at a time."""
        from dataflow.models.hf import save_pretrained

        blocks = ((ref.kind, ref.layer, self.read_block(ref)) for ref in self.block_refs())
        return save_pretrained(self.plan.model, blocks, path, overwrite=overwrite)

    def close(self) -> None:
        """Release the engine's device and host memory (both arenas, the backend's slabs and
        library scratch) now; every later public call raises ConfigError naming it. Waits
        for a call running in another thread; closing twice does nothing."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return  # setup never started
        with lock:
            if getattr(self, "_closed", True) and getattr(self, "ex", None) is None:
                return
            self._closed = True
            be = getattr(self, "be", None)
            if be is not None:
                try:
                    be.synchronize()
                finally:
                    be.close()
            # Drop every reference to the arenas' memory: the executor (arenas, views, slot
            # rings), the backend (slabs) and the last trace; then collect the cycles below.
            self.ex = self.be = self.last_trace = None
            # Collect this engine's reference cycles now, on this thread: left to a later
            # collection, one triggered inside a host function that runs on the CUDA driver's
            # thread frees CuPy memory, events and streams there, where CUDA refuses it
            # (cudaErrorNotPermitted, seen once in a GPU test that ran two engines in a row).
            gc.collect()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PhaseClock:
    """Wall seconds between successive laps, by name (setup's phase breakdown)."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


MOE_NO_OPS = "this backend's op table has no MoE ops (moe_route, ...); use --backend numpy or cupy"
"""Why refuse_moe_backend refuses: both op tables (dataflow.ops_numpy, dataflow.ops_cuda) have the
MoE ops; a backend brought by the caller with another table may not."""


def refuse_moe_backend(cfg: ModelConfig, backend) -> None:
    """Refuse an MoE model (ModelConfig.moe) on a backend whose op table has no MoE ops
    ('moe_route' not among its writes), by name. `backend`: a Backend, or the kind asked for
    ('numpy', 'cupy', 'auto': each picks a table that has them, so a name is never refused). The
    null backend, which has no op table and runs nothing, is let through."""
    if cfg.moe is None or isinstance(backend, str):
        return
    if backend.ops is not None and "moe_route" not in backend.writes:
        raise ConfigError(f"model '{cfg.name}' ({cfg.family}, {cfg.moe.n_experts} experts) on "
                          f"the {backend.name} backend: {MOE_NO_OPS} (backend='numpy' or "
                          "'cupy')")


def _backend(options: RunOptions):
    kind = options.backend
    if isinstance(kind, Backend):
        return kind  # the caller brought its own (a traced or recording backend, a ring rank's)
    return make_backend(kind, **({"sanitize": True, "seed": options.sanitize_seed}
                                 if options.sanitize else {}))


@functools.cache
def _init_keywords() -> frozenset[str]:
    """The keywords Engine() takes (its signature is the one list of them)."""
    import inspect

    params = inspect.signature(Engine.__init__).parameters
    return frozenset(name for name, p in params.items() if p.kind is p.KEYWORD_ONLY)


def _checkpoint_options(path: Path, options: RunOptions) -> tuple[ModelConfig, RunOptions]:
    """The model of checkpoint `path` and the options to resume it with: weights come from the
    checkpoint, AdamW settings left at their defaults take the checkpoint's."""
    from dataflow.checkpoint import read_checkpoint
    from dataflow.models.serial import from_dict

    if options.weights is not None:
        raise ConfigError(f"{path} is a checkpoint, which brings its own weights, and weights= "
                          "was passed as well; drop weights=, or build the Engine on a model "
                          "name and call load_checkpoint yourself")
    path, meta = read_checkpoint(path)
    cfg = from_dict(ModelConfig, meta["model"], where=f"{path} model")
    stored = from_dict(AdamWConfig, meta["optimizer"], where=f"{path} optimizer")
    adamw = options.optimizer or with_checkpoint_defaults(options.adamw(), stored)
    return cfg, dataclasses.replace(options, weights=_FROM_CHECKPOINT, optimizer=adamw)


def _plain(value):
    """`value` in JSON's types: dataclasses as dicts, enums by value, NumPy scalars as Python."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k.value if isinstance(k, enum.Enum) else k): _plain(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _checked_tensor(state: dict, name: str, shape: tuple, bf16: np.dtype):
    """(array, None) when state[name] can load into a tensor of `shape`, else (None, problem)."""
    if name not in state:
        return None, f"missing '{name}'"
    value = state[name]
    if not isinstance(value, np.ndarray):
        try:
            value = _as_numpy_any(value)
        except (TypeError, ValueError, RuntimeError, BufferError) as exc:
            return None, f"'{name}' is a {type(value).__name__} that NumPy cannot read ({exc})"
    dt = value.dtype
    if dt.kind == "V" and dt != bf16:
        if dt.itemsize != 2 or dt.fields is not None:
            return None, (f"'{name}' holds raw {dt.itemsize}-byte values ({dt.str}); save "
                          "bf16 with its dtype (ml_dtypes.bfloat16) or as float32")
        value = value.view(bf16)  # np.savez keeps bf16 as 2-byte void: same bits
    elif dt != bf16 and dt.kind != "f":
        return None, f"'{name}' has dtype {dt}; expected a float dtype (bf16, float16/32/64)"
    if tuple(value.shape) != tuple(shape):
        return None, f"'{name}' has shape {tuple(value.shape)}, expected {tuple(shape)}"
    if not np.isfinite(value).all():
        return None, f"'{name}' holds NaN or infinite values; load a healthy checkpoint"
    return value, None


def _as_numpy_any(value) -> np.ndarray:
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError):
            pass
    if hasattr(value, "get"):  # CuPy arrays
        value = value.get()
    return np.asarray(value)


def _nonfinite_name(value: float) -> str:
    return "NaN" if np.isnan(value) else ("+inf" if value > 0 else "-inf")


def default_profile(be):
    """The planner's hardware profile for this backend: 'cpu' for NumPy; for a GPU, the built-in
    (or cached, measured) profile whose name the device name contains, else H100's."""
    from dataflow.memplan.plan.profiles import get_profile, profile_for_device

    if be.name == "numpy":
        return get_profile("cpu")
    return profile_for_device(getattr(be, "device_name", ""))
