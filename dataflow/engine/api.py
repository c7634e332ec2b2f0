"""The Engine: the API other trainers embed. Plans a model (or takes a Plan), starts it once
(dataflow.engine.setup), trains and evaluates one step per call (dataflow.engine.steps) and reads
and writes its state (dataflow.engine.state_io), each public call under one lock. Owns the
hyperparameters and the step counter; the executor owns the schedule. Never decides placement."""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import threading
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dataflow import checkpoint, lora_checkpoint
from dataflow.backend import Backend, Place
from dataflow.engine.setup import Started, backend_for, plan_engine, start
from dataflow.engine.state_io import BlockRef
from dataflow.engine.steps import CONFIGURED, StepResult
from dataflow.engine_options import EngineOptions, RunOptions, check_option_names
from dataflow.memplan.plan.plan import Plan
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models import hf
from dataflow.optimizer import AdamW, AdamWConfig


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
    load_checkpoint, save_pretrained, lora_state, load_lora_state, export_peft, save_merged,
    set_lr, memory_used_bytes, close) are serialised by one
    lock: a call made while another thread's call runs waits for it, so an eval_step from a
    background thread runs between two train_steps, never inside one. The order in which
    waiting threads get the lock is not defined; a trainer that needs an order (step 2 after
    step 1) orders its own threads. step_progress and the read-only properties (lr, step,
    seqs_per_step) take no lock, so another thread can watch a long step. After close() every
    public call raises ConfigError naming the call.

    Its parts: the set-up (dataflow.engine.setup) gives the plan, the backend `be`, the executor
    `ex`, the AdamW driver, a StepRunner (steps) and a StateIO (state in and out).
    """

    def __new__(cls, *args, ring=None, **kwargs):
        options = kwargs["options"] if "options" in kwargs else (
            args[1] if len(args) > 1 else None)
        if options is not None:
            _check_options_alone(options, kwargs)
        if ring is not None:  # the ring builds this process's rank (dataflow.ring.engine.RingEngine)
            if kwargs.get("freeze") or getattr(options, "freeze", None):
                raise ConfigError("freeze= is built for one device so far (docs/freeze.md), not "
                                  "for a ring; drop ring= or freeze=")
            if kwargs.get("lora") is not None or getattr(options, "lora", None) is not None:
                raise ConfigError("lora= is built for one device so far (docs/lora.md), not "
                                  "for a ring; drop ring= or lora=")
            if options is not None:  # the same engine as its fields passed as keywords
                return ring.engine(*args[:1], **options.keywords())
            return ring.engine(*args, **kwargs)
        # Python names only the keyword; this also names the closest one the Engine takes
        check_option_names(kwargs, _init_keywords(), "Engine()")
        return super().__new__(cls)

    def __init__(self, model: str | Path | ModelConfig, options: EngineOptions | None = None, *,
                 host_gb: float | None = None, dev_gb: float | None = None,
                 seqlen: int | None = None, seqs_per_step: int | None = None,
                 tokens_per_step: int | None = None, precision: str = "bf16", freeze=None,
                 lora=None, backend: str | Backend = "auto",
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
        options: a dataflow.engine_options.EngineOptions holding every keyword below but ring
            (its `run`, a RunOptions, those from backend on), instead of the keywords: the
            same engine, e.g. Engine("tiny", EngineOptions(host_gb=1, dev_gb=0.25,
            seqlen=128, run=RunOptions(backend="numpy"))).
        host_gb, dev_gb: the host and device memory budgets in GiB (2^30 bytes).
        seqlen: tokens per sequence (a batch row holds seqlen + 1 ids).
        seqs_per_step / tokens_per_step (a multiple of seqlen): the global batch of one
            optimizer step, which the planner keeps, choosing chunks and rounds under the
            budgets (InfeasibleBudget names the smallest budgets for it); default: the
            planner's choice (read it as eng.seqs_per_step).
        precision: 'bf16' (default) or 'fp8': the block projections' GEMMs in the FP8 recipe
            of docs/fp8.md, planned with its FP8 scratch (Plan.precision; from_plan runs the
            plan's). On an sm_89+ GPU or the NumPy backend; an older GPU refuses it by name.
        freeze: blocks that train no further, e.g. 'embed,head,layers:0-29' (docs/freeze.md;
            Plan.frozen): their weights stay as loaded, with no gradient, AdamW state, gradient
            copy or weight-gradient GEMM; the planner counts only what trains.
        lora: LoRA adapters (docs/lora.md): a dataflow.memplan.plan.lora.Lora, a rank, or
            dict(rank=, alpha=, targets=, base=) (alpha defaults to the rank, targets to all
            seven, base to 'bf16'; base='fp8' stores the base's seven linears as E4M3 codes with
            row scales, quantised once at load: the model trained is the FP8-rounded base plus
            the adapters); the base is frozen whole, the adapters start as PEFT's (seeded by
            `seed`) and train in fp32 on the device. Read them with lora_state().
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
        if options is None:
            missing = [name for name, value in (("host_gb", host_gb), ("dev_gb", dev_gb),
                                                ("seqlen", seqlen)) if value is None]
            if missing:  # required unless options brings them: Python's own TypeError
                raise TypeError(_missing_message(missing))
            options = EngineOptions(
                host_gb=host_gb, dev_gb=dev_gb, seqlen=seqlen, seqs_per_step=seqs_per_step,
                tokens_per_step=tokens_per_step, profile=profile, plan_options=plan_options,
                precision=precision, freeze=freeze, lora=lora,
                run=RunOptions(backend=backend, seed=seed, weights=weights, lr=lr, betas=betas,
                               eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                               optimizer=optimizer, lr_schedule=lr_schedule, sanitize=sanitize,
                               sanitize_seed=sanitize_seed, trace=trace, progress=progress,
                               schedule=schedule, deferred_update=deferred_update,
                               backward_update=backward_update))
        planned = plan_engine(model, options)
        source = checkpoint.model_source(planned.resume, planned.run.weights)  # HF files kept
        self._adopt(start(planned.plan, planned.backend, planned.run))
        self.model_source = source
        if planned.resume is not None:
            try:  # the settings the caller passed are deliberate changes of the checkpoint's
                self.load_checkpoint(planned.resume, allow_changes=True)
            except BaseException:
                self.close()  # its blocks were never written: no half-built engine is left
                raise
        self.setup_seconds = {**planned.seconds, **self.setup_seconds}

    @classmethod
    def from_plan(cls, plan: Plan, options: RunOptions | None = None, **keywords) -> "Engine":
        """Start a plan you made or edited. options: a dataflow.engine_options.RunOptions, or
        instead its fields as keywords: those of Engine() from backend on (backend, seed,
        weights, lr, betas, eps, weight_decay, max_grad_norm, optimizer, lr_schedule, trace,
        progress, schedule, deferred_update, backward_update, sanitize, sanitize_seed), with
        the same defaults and meaning; a misspelt one raises UnknownOptionError naming the
        closest."""
        if options is None:
            run = RunOptions.from_keywords(keywords, "Engine.from_plan()")
        elif keywords:
            raise ConfigError(f"Engine.from_plan() got options and the keyword(s) "
                              f"{', '.join(sorted(keywords))}; pass them inside the RunOptions "
                              "(dataclasses.replace(options, ...)) or as keywords alone")
        else:
            run = options
        if not (plan.holds_embed and plan.holds_head):
            raise ConfigError(f"this plan of {plan.model.name} is one ring rank's (it holds "
                              f"{'no embedding' if not plan.holds_embed else 'the embedding'} "
                              f"and {'no head' if not plan.holds_head else 'the head'}); train "
                              "it as a ring (Engine(..., ring=dataflow.ring.engine.Ring()), dataflow-ring) "
                              "or plan one device with make_plan")
        run.check()
        self = object.__new__(cls)
        self._adopt(start(plan, backend_for(run), run))
        self.model_source = checkpoint.model_source(None, run.weights)
        return self

    def _adopt(self, started: Started) -> None:
        """Take the parts of a started engine; from here on the public calls run."""
        self._lock = threading.RLock()
        self.plan, self.be, self.ex = started.plan, started.be, started.ex
        self._optimizer = started.optimizer
        self._steps, self._state = started.steps, started.state
        self.prebuild_parts = started.prebuild_parts
        """What the setup-time build in a thread took (seconds per part, and total)."""
        self.warm_up_parts = started.warm_up_parts
        """warm_up's own breakdown: seconds per part (host_kernels, and on the GPU cuda_modules,
        attention_graphs) and, on the GPU, attention_graphs_built / _from_cache (counts)."""
        self.setup_seconds = dict(started.setup_seconds)
        """Wall seconds of each setup phase (constructor also: backend, plan), in order."""
        self._closed = False

    # -- state in and out (dataflow.engine.state_io) ------------------------------------------
    @_serialised
    def weights(self):
        """The current parameters as a dataflow.models.init.ModelWeights (host copies)."""
        return self._state.weights()

    @_serialised
    def lora_state(self) -> dict[str, np.ndarray]:
        """The LoRA adapters (fp32): 'layers.{i}.{target}.a' (r, in) and '.b' (out, r), their
        AdamW state '.m' / '.v' and gradient '.grad' (zero between steps); a pending deferred
        update runs first. Refused without lora=."""
        lora = self._adapters("lora_state")
        self.ex.flush()
        return lora.state(self.ex.download)

    @_serialised
    def load_lora_state(self, tensors: dict[str, np.ndarray]) -> None:
        """Replace the adapters (and the AdamW m / v given; missing ones start at zero) with
        `tensors` keyed as lora_state() names them."""
        lora = self._adapters("load_lora_state")
        self.ex.flush()
        lora.load(tensors, self.ex.upload)

    def _adapters(self, call: str):
        if self.ex.lora is None:
            raise ConfigError(f"{call}(): this engine has no LoRA adapters; build it with "
                              "lora=R (docs/lora.md)")
        return self.ex.lora

    @_serialised
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters under transformers' names and shapes, plus AdamW state as
        'optimizer.<name>.exp_avg' / '.exp_avg_sq' and 'optimizer.step'."""
        return self._state.state_dict()

    @_serialised
    def load_state_dict(self, state: dict, *, weights_only: bool = False) -> None:
        """Inverse of state_dict. Every key, shape and dtype is checked before anything is
        written, so a bad state leaves the engine as it was; the error lists each problem with
        the tensor's name and the fix. Tensors may be any float dtype or bf16 (bf16 saved by
        np.savez comes back as raw 2-byte void '|V2' and is read as ml_dtypes.bfloat16).
        weights_only: load the parameters alone (e.g. weights from another trainer): AdamW
        state is zeroed and the step count restarts at 0; 'optimizer.*' keys are ignored.
        Loading also clears gradients and lets an engine whose step failed train again. A
        frozen block (freeze=) takes its weights alone; AdamW keys of it are passed over."""
        self._state.load_state_dict(state, weights_only)

    @_serialised
    def block_refs(self) -> tuple[BlockRef, ...]:
        """Every block in model order: embed, layers 0..L-1, head."""
        return self._state.block_refs()

    @_serialised
    def layout(self, ref: BlockRef):
        """The block's layout (tensors with transformers' names and shapes, numel, views)."""
        return self._state.layout_of(ref.kind)

    @_serialised
    def read_block(self, ref: BlockRef, part: str = "weights") -> np.ndarray:
        """A host copy of one block's weights, AdamW m or v (synchronous; one block at a time,
        so saving a large model never holds more than a block beside the arenas)."""
        return self._state.read_block(ref, part)

    @_serialised
    def write_block(self, ref: BlockRef, array: np.ndarray, part: str = "weights") -> None:
        """Overwrite one block's weights, AdamW m or v with `array` (numel elements, bf16)."""
        self._state.write_block(ref, array, part)

    @_serialised
    def save_checkpoint(self, path, *, data: dict | None = None, rng=None,
                        extra: dict | None = None, keep: int | None = None,
                        force_dir: bool = False, allow_failed_step: bool = False):
        """Save weights, AdamW m and v, step, schedule and the caller's data position, RNG
        state and `extra` to `path/step_<step>` (atomic, one block in host memory at a time);
        keep: afterwards delete all but the newest `keep`. Returns the checkpoint's path.

        Refused, nothing written: a `path` that holds anything but checkpoints (a model,
        other files; ConfigError) unless force_dir=True; and after a failed step whose state
        may be half-updated (StepFailedError) unless allow_failed_step=True, which marks the
        checkpoint (checkpoint.json's failed_step; loading it warns)."""
        failed = self._steps.check_savable("save_checkpoint", allow_failed_step)
        if self.ex.lora is not None:  # the adapters alone, and the base's identity
            return lora_checkpoint.save_lora_checkpoint(self, path, data=data, rng=rng,
                                                        extra=extra, keep=keep,
                                                        force_dir=force_dir)
        return checkpoint.save_checkpoint(self, path, data=data, rng=rng, extra=extra, keep=keep,
                                          force_dir=force_dir, failed_step=failed)

    @_serialised
    def load_checkpoint(self, path, *, verify: bool = True, allow_changes: bool = False):
        """Restore from a checkpoint directory (or the newest under a root); any plan of the
        same model loads it. Returns a dataflow.checkpoint.CheckpointInfo (step, data, rng).
        After a failed step it is a way back, as load_state_dict is: once the checkpoint is
        checked, the half-accumulated gradients and AdamW state are zeroed before its blocks
        are written, and the engine trains again."""
        if self.ex.lora is not None:  # a LoRA checkpoint: adapters, AdamW state, step
            info = lora_checkpoint.load_lora_checkpoint(self, path)
            self._steps.failed_step = None
            return info
        failed = self._steps.failed_step is not None
        info = checkpoint.load_checkpoint(
            self, path, verify=verify, allow_changes=allow_changes,
            before_writes=self._state.discard_failed_step if failed else None)
        self._steps.failed_step = None
        return info

    @_serialised
    def save_pretrained(self, path, *, overwrite: bool = False, allow_failed_step: bool = False):
        """Write the weights as a Hugging Face directory of the model's family in bf16
        (config.json and safetensors, plus the source's tokenizer and generation config when
        the model came from a Hugging Face directory), one block in host memory at a time.
        After a failed step whose weights may be half-updated it refuses (StepFailedError)
        unless allow_failed_step=True (then it warns: the directory has no place to mark it)."""
        if self._steps.check_savable("save_pretrained", allow_failed_step) is not None:
            warnings.warn(f"save_pretrained writes {path} after step "
                          f"{self._steps.failed_step.step} failed: its weights may be "
                          "half-updated", UserWarning, stacklevel=3)
        return hf.save_pretrained(self.plan.model, self._state.pretrained_blocks(), path,
                               overwrite=overwrite, source=self.model_source)

    @_serialised
    def export_peft(self, path, *, base_model: str | None = None, overwrite: bool = False):
        """Write the LoRA adapters as a PEFT adapter directory (adapter_config.json,
        adapter_model.safetensors; docs/lora.md), atomically. Returns the path."""
        return lora_checkpoint.export_peft(self, path, base_model=base_model, overwrite=overwrite)

    @_serialised
    def save_merged(self, path, *, overwrite: bool = False):
        """Write base + alpha/r B A as a Hugging Face directory in bf16 (as save_pretrained)."""
        lora = self._adapters("save_merged")
        blocks = lora_checkpoint.merged_blocks(self.plan.model, self.plan.lora,
                                               self._state.pretrained_blocks(),
                                               lora.state(self.ex.download))
        return hf.save_pretrained(self.plan.model, blocks, path, overwrite=overwrite,
                                  source=self.model_source)

    # -- training (dataflow.engine.steps) -----------------------------------------------------
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

    @property
    def last_trace(self):
        """The last step's trace (a TracingBackend's spans) when the engine traces, else None."""
        steps = getattr(self, "_steps", None)
        return steps.last_trace if steps is not None else None

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
        return self._steps.train(tokens, labels, doc_ids, position_ids, lr, max_grad_norm)

    @_serialised
    def eval_step(self, tokens, labels=None, *, doc_ids=None, position_ids=None) -> float:
        """The mean loss over the counted targets of `tokens` (any number of rows of
        seqlen + 1 ids, up to 512 rounds; same labels / doc_ids / position_ids conventions as
        train_step), forward only: no gradient is kept, no weight, AdamW state or step count
        changes (bit-identical before and after), so it may run between any two train_steps."""
        return self._steps.evaluate(tokens, labels, doc_ids, position_ids)

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

    @_serialised
    def memory_used_bytes(self) -> dict[str, int]:
        """Arena bytes per place (the budgets) and the bytes the plan's regions occupy."""
        return {"device_arena": self.be.memory_used_bytes(Place.DEVICE),
                "host_arena": self.be.memory_used_bytes(Place.HOST),
                "device_regions": self.ex.dev.used_bytes, "host_regions": self.ex.host.used_bytes}

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ConfigError(f"Engine is closed: {call} cannot run, because close() released "
                              "the engine's memory; create a new Engine (pass a checkpoint "
                              "directory as its model to continue a saved run)")

    def close(self) -> None:
        """Release the engine's device and host memory (both arenas, the backend's slabs and
        library scratch) now; every later public call raises ConfigError naming it. Waits
        for a call running in another thread; closing twice does nothing."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return  # setup never finished
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
            # rings), the backend (slabs), the parts that hold them and the last trace (the
            # step runner's); then collect the cycles below.
            self.ex = self.be = self._steps = self._state = None
            # Collect this engine's reference cycles now, on this thread: left to a later
            # collection, one triggered inside a host function that runs on the CUDA driver's
            # thread frees CuPy memory, events and streams there, where CUDA refuses it
            # (cudaErrorNotPermitted, seen once in a GPU test that ran two engines in a row).
            gc.collect()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def _init_keywords() -> frozenset[str]:
    """The keywords Engine() takes: its signature's keyword-only ones (the one list of them)
    and options."""
    params = inspect.signature(Engine.__init__).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind is p.KEYWORD_ONLY or name == "options")


def _check_options_alone(options, keywords: dict) -> None:
    """Refuse an options object that is not an EngineOptions, or one passed beside keywords."""
    if not isinstance(options, EngineOptions):
        raise TypeError(f"Engine() options must be a dataflow.engine_options.EngineOptions, not "
                        f"{type(options).__name__}; or pass host_gb=, dev_gb=, seqlen=, ... as "
                        "keywords")
    extra = sorted(set(keywords) - {"options"})
    if extra:
        raise ConfigError(f"Engine() got options and the keyword(s) {', '.join(extra)}; pass "
                          "them inside the EngineOptions (dataclasses.replace(options, ...)) or "
                          "as keywords alone")


def _missing_message(names: list[str]) -> str:
    """Python's own words for missing keyword-only arguments of Engine.__init__."""
    quoted = [repr(n) for n in names]
    listed = quoted[0] if len(quoted) == 1 else (
        " and ".join(quoted) if len(quoted) == 2 else ", ".join(quoted[:-1]) + ", and " + quoted[-1])
    s = "" if len(names) == 1 else "s"
    return f"Engine.__init__() missing {len(names)} required keyword-only argument{s}: {listed}"
