"""Setting an Engine up, once: the plan for a model under the budgets (or the checkpoint it
resumes), the backend, the arenas (through the Executor), the AdamW driver, the weights
initialised or loaded straight into their homes, and the warm-up of what step 1 would build.
Never trains and never decides placement: the planner does, and the executor obeys."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from pathlib import Path

from dataflow.lora_adapters import peft_init
from dataflow.lora_checkpoint import is_lora_checkpoint
from dataflow.backend import Backend
from dataflow.backends import make_backend
from dataflow.block_io import init_weights as init_block_weights
from dataflow.fp8_base import init_fill
from dataflow.checkpoint import read_checkpoint
from dataflow.engine.state_io import StateIO
from dataflow.engine.steps import StepRunner
from dataflow.engine_options import (EngineOptions, RunOptions, checkpoint_dir,
                                     with_checkpoint_defaults)
from dataflow.executor import Executor
from dataflow.instrument import TracingBackend
from dataflow.memplan import make_plan
from dataflow.memplan.search.cost import workload_of
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.memplan.plan.profiles import get_profile, profile_for_device
from dataflow.models import init
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.hf import open_weights, weight_map
from dataflow.models.hf_config import is_hf_dir, model_config
from dataflow.models.layout import BlockKind
from dataflow.models.safetensors_io import SafetensorsFile
from dataflow.models.serial import from_dict
from dataflow.optimizer import AdamW, AdamWConfig
from dataflow.warmup import start_host_compile, start_prebuild, warm_up

FROM_CHECKPOINT = object()
"""weights= of an engine built on a checkpoint: leave the blocks for load_checkpoint to write."""

MOE_NO_OPS = "this backend's op table has no MoE ops (moe_route, ...); use --backend numpy or cupy"
"""Why refuse_moe_backend refuses: both op tables (dataflow.ops_numpy, dataflow.ops_cuda) have the
MoE ops; a backend brought by the caller with another table may not."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """What the constructor's planning gives the start: the plan, the backend it runs on, the
    run options (a resumed checkpoint's filled in), the checkpoint to resume (or None) and the
    wall seconds of the backend and the planner."""

    plan: Plan
    backend: object
    run: RunOptions
    resume: Path | None
    seconds: dict


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    """A started engine's parts: the executor (arenas, schedule), the backend (traced when asked),
    the AdamW driver, the step runner, the state reader / writer and the set-up's timings."""

    plan: Plan
    be: object
    ex: Executor
    optimizer: AdamW
    steps: StepRunner
    state: StateIO
    setup_seconds: dict
    """Wall seconds of each setup phase, in order."""
    warm_up_parts: dict
    prebuild_parts: dict


def plan_engine(model, options: EngineOptions) -> Planned:
    """Resolve `model` (a zoo name, config, model, Hugging Face or checkpoint directory), check
    the options, make the backend and plan the model under the budgets."""
    run = options.run
    resume = checkpoint_dir(model)
    if resume is not None and is_lora_checkpoint(resume):
        raise ConfigError(f"{resume} is a LoRA checkpoint (adapters alone, docs/lora.md): build "
                          "the Engine from its base model with the same lora=, then call "
                          "load_checkpoint on it")
    if resume is not None:
        cfg, run = checkpoint_options(resume, run)
    else:
        if not isinstance(model, ModelConfig) and is_hf_dir(model) and run.weights is None:
            run = dataclasses.replace(run, weights=model)  # HF brings its weights
        cfg = model if isinstance(model, ModelConfig) else model_config(model)
    run.check()
    refuse_moe_backend(cfg, run.backend)  # a caller's own backend, before the plan
    if isinstance(run.weights, (str, Path)):  # before the plan: a wrong config can take long
        check_weights_match(cfg, run.weights)
    t0 = time.perf_counter()
    be = backend_for(run)
    be.set_precision(options.precision)  # a backend without it refuses here, before planning
    t1 = time.perf_counter()
    plan = make_plan(cfg, options.seqlen, Budget.from_gib(options.host_gb, options.dev_gb),
                     options.profile or default_profile(be), **options.plan_keywords())
    t2 = time.perf_counter()
    return Planned(plan=plan, backend=be, run=run, resume=resume,
                   seconds={"backend": t1 - t0, "plan": t2 - t1})


def start(plan: Plan, be, options: RunOptions) -> Started:
    """Bind `plan` to `be`: arenas, AdamW, zeroed state, weights, seal and warm-up."""
    refuse_moe_backend(plan.model, be)
    be.set_precision(plan.precision.value)  # its op table's linear layers (dataflow.precision)
    be = TracingBackend(be) if options.trace else be
    # numba compiles the plan's host kernels (seconds each, cold) in another process while
    # this one pins, clears and initialises; warm_up then loads them from numba's cache
    background = start_host_compile(plan)
    try:
        return _start_parts(plan, be, options, background)
    except BaseException:
        if background is not None:
            background.kill()
            background.wait()
        raise


def _start_parts(plan: Plan, be, options: RunOptions, background) -> Started:
    # The hardware FLOPs a round adds beyond the model's (recompute by level, attention
    # score recompute, segment re-runs, K/V re-forming), as the prediction counts them, so
    # HFU compares with it; fixed by the plan, so counted once, not every step.
    extra_flops = workload_of(plan, plan.profile).extra_flops
    clock = _PhaseClock()
    # CUDA modules and cuDNN graphs are built in a thread while the executor pins the host
    # slab (host work both; pinning 120 GiB takes 10-30 s); warm_up then finds them built
    prebuild = start_prebuild(plan, be)
    try:
        ex = Executor(plan, be, options.schedule, deferred_update=options.deferred_update,
                      backward_update=options.backward_update)
    finally:
        prebuild_parts = prebuild.join() if prebuild is not None else {}
    clock.lap("executor")  # schedule, both arenas (pinning the host slab), library scratch
    optimizer = AdamW(options.adamw(), options.lr_schedule)
    steps = StepRunner(plan, be, ex, optimizer, extra_flops)
    state = StateIO(plan, be, ex, optimizer, steps)
    state.zero_state()
    clock.lap("zero_state")
    weights, progress = options.weights, options.progress
    if weights is FROM_CHECKPOINT:
        pass  # the constructor's load_checkpoint writes every block next
    elif weights is None:
        init_weights(state, options.seed, progress)
        clock.lap("init_weights")
    else:
        if isinstance(weights, (str, Path)):
            weights = open_weights(weights)  # a model directory or a Hugging Face one
        load_weights(state, weights, progress)
        clock.lap("load_weights")
    if ex.lora is not None:  # fresh adapters as PEFT makes them (a checkpoint's replace them)
        ex.lora.load(peft_init(plan.model, plan.lora, options.seed), ex.upload)
    be.synchronize()
    clock.lap("synchronize")
    be.seal()  # from here on every device byte comes from the arenas
    # what step 1 would build on first use (CUDA modules, cuDNN graphs, numba kernels),
    # built now, after the seal, so the guard sees any allocation it might make
    warm = warm_up(plan, be, ex.schedule, background)
    clock.lap("warm_up")
    return Started(plan=plan, be=be, ex=ex, optimizer=optimizer, steps=steps, state=state,
                   setup_seconds=clock.laps, warm_up_parts=warm, prebuild_parts=prebuild_parts)


def init_weights(state: StateIO, seed: int, progress) -> None:
    """Initialise each block straight into where it lives (dataflow.block_io.init_weights:
    home, else the device when it is host memory, else the pinned io staging and one H2D
    copy). No block passes through a temporary; copies from home are asynchronous and the
    start synchronises once at the end."""
    cfg = state.plan.model
    fill = {BlockKind.EMBED: lambda layer, out: init.init_embed_block(cfg, seed, out=out),
            BlockKind.LAYER: lambda layer, out: init.init_layer_block(cfg, layer, seed, out=out),
            BlockKind.HEAD: lambda layer, out: init.init_head_block(cfg, seed, out=out)}
    for b in state.targets():
        # an fp8 base's layer: initialised in bf16, then quantised once (dataflow.fp8_base)
        init_block_weights(state.ex, state.be, b, init_fill(
            b.layout, functools.partial(fill[b.kind], b.layer), b.layer))
        if progress is not None:
            progress.update()


def load_weights(state: StateIO, weights, progress) -> None:
    """Write a dataflow.models.init.ModelWeights (or a lazy HFWeights) block by block."""
    model = state.plan.model
    if weights.cfg != model:
        raise ConfigError(f"weights are for model '{weights.cfg.name}' but the plan is for "
                          f"'{model.name}'; load matching weights")
    blocks = (blk[3] for blk in weights.blocks())  # lazy: HFWeights reads block by block
    for b, block in zip(state.targets(), blocks):
        state.write(b, block)
        if progress is not None:
            progress.update()


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
EMBED_NAME = "model.embed_tokens.weight"


def check_weights_match(cfg: ModelConfig, path) -> None:
    """Refuse a model directory whose weights do not have the shape its config says: the number
    of layers stored, the hidden size and the vocabulary (Hugging Face: read from the safetensors
    headers and index only, no tensor; a saved model: its manifest's block count). Cheap, so it
    runs before planning: a config.json saying 1,000,000 layers over weights for 2 must fail in a
    line, not after the planner has searched a million-layer model."""
    path = Path(path)
    if is_hf_dir(path):
        shapes = _hf_shapes(path)
        layers = {int(m.group(1)) for n in shapes if (m := _LAYER_NAME.match(n))}
        stored = max(layers) + 1 if layers else 0
        if stored != cfg.n_layers:
            raise ConfigError(f"{path / 'config.json'} says num_hidden_layers {cfg.n_layers:,} "
                              f"but the weights hold {stored:,} layer(s); config.json and the "
                              f"weights disagree: set num_hidden_layers {stored}")
        embed = shapes.get(EMBED_NAME)
        if embed is not None and tuple(embed) != (cfg.vocab_size, cfg.model_dim):
            raise ConfigError(f"{path / 'config.json'} says vocab_size {cfg.vocab_size:,} and "
                              f"hidden_size {cfg.model_dim:,} but {EMBED_NAME} has shape "
                              f"{list(embed)}; config.json and the weights disagree")
    elif (path / "manifest.json").is_file():
        try:
            blocks = json.loads((path / "manifest.json").read_text()).get("blocks")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return  # read_manifest names a damaged manifest when the weights are loaded
        stored = sum(1 for b in blocks if isinstance(b, dict) and b.get("kind") == "layer") \
            if isinstance(blocks, list) else cfg.n_layers
        if stored != cfg.n_layers:
            raise ConfigError(f"{path / 'config.json'} says n_layers {cfg.n_layers:,} but "
                              f"{path / 'manifest.json'} lists {stored:,} layer block(s); the "
                              "config and the weights disagree: re-save the model")


def _hf_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Tensor name -> shape of a Hugging Face directory (None for tensors of shards that are
    not read: only the shard holding the embedding is opened)."""
    where = weight_map(path)
    shapes = dict.fromkeys(where)
    if EMBED_NAME in where:
        f = SafetensorsFile(path / where[EMBED_NAME])
        if EMBED_NAME in f:
            shapes[EMBED_NAME] = f.shape(EMBED_NAME)
    return shapes


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


def backend_for(options: RunOptions):
    """The backend `options` names (made here), or the one the caller brought."""
    kind = options.backend
    if isinstance(kind, Backend):
        return kind  # the caller brought its own (a traced or recording backend, a ring rank's)
    return make_backend(kind, **({"sanitize": True, "seed": options.sanitize_seed}
                                 if options.sanitize else {}))


def default_profile(be):
    """The planner's hardware profile for this backend: 'cpu' for NumPy; for a GPU, the built-in
    (or cached, measured) profile whose name the device name contains, else H100's."""
    if be.name == "numpy":
        return get_profile("cpu")
    return profile_for_device(getattr(be, "device_name", ""))


def checkpoint_options(path: Path, options: RunOptions) -> tuple[ModelConfig, RunOptions]:
    """The model of checkpoint `path` and the options to resume it with: weights come from the
    checkpoint, AdamW settings left at their defaults take the checkpoint's."""
    if options.weights is not None:
        raise ConfigError(f"{path} is a checkpoint, which brings its own weights, and weights= "
                          "was passed as well; drop weights=, or build the Engine on a model "
                          "name and call load_checkpoint yourself")
    path, meta = read_checkpoint(path)
    cfg = from_dict(ModelConfig, meta["model"], where=f"{path} model")
    stored = from_dict(AdamWConfig, meta["optimizer"], where=f"{path} optimizer")
    adamw = options.optimizer or with_checkpoint_defaults(options.adamw(), stored)
    return cfg, dataclasses.replace(options, weights=FROM_CHECKPOINT, optimizer=adamw)


class _PhaseClock:
    """Wall seconds between successive laps, by name (setup's phase breakdown)."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now
