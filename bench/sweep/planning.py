"""Plans sweep cells in the sweeping process: picks the backend and hardware profile the cells
will run with, turns a plan into the table's plan columns, and records the cells the planner
refuses (or, with --predict-only, every cell) without starting a process. Pure planning: never
imports array libraries and never creates a CUDA context, so the parent's own device memory
cannot leak into a cell's measurement."""

from __future__ import annotations

import datetime
import importlib.util
import logging
import socket

from dataflow.bench.sweep.grid import Cell
from dataflow.bench.sweep.record import CellRecord, Status
from dataflow.memplan import InfeasibleBudget, make_plan
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.plan.lora import Lora
from dataflow.memplan.plan.plan import Budget, HardwareProfile, OptimizerWhere, Plan, Where
from dataflow.memplan.plan.profiles import get_profile, known_profiles, load_profile
from dataflow.models.flops import SavedLevel
from dataflow.models.hf_config import model_config

log = logging.getLogger("dataflow.sweep")


def gpu_names() -> tuple[str, ...]:
    """Names of the GPUs NVML sees (empty without a driver); never creates a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return ()
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return tuple(names)
    finally:
        pynvml.nvmlShutdown()


def resolve_backend(requested: str) -> str:
    """'numpy' or 'cupy'. 'auto' is 'cupy' when CuPy is installed and NVML sees a GPU, as the
    demo's own 'auto' would choose; the answer is then passed to every cell explicitly."""
    if requested != "auto":
        return requested
    return "cupy" if importlib.util.find_spec("cupy") is not None and gpu_names() else "numpy"


def resolve_profile(backend: str, *, gpu: str | None = None, profile_file: str | None = None,
                    predict_only: bool = False) -> HardwareProfile:
    """The profile to plan for: --profile FILE or --gpu NAME when given; 'cpu' for the NumPy
    backend (as the demo plans); else the built-in profile matching the local GPU's name (as
    dataflow.engine.default_profile matches it), H100's when none matches or no GPU is here."""
    if profile_file:
        return load_profile(profile_file)
    if gpu:
        return get_profile(gpu)
    if backend == "numpy" and not predict_only:
        return get_profile("cpu")
    names = gpu_names()
    if backend == "numpy" and not names:
        return get_profile("cpu")
    for name in names[:1]:
        key = "".join(ch for ch in name.lower() if ch.isalnum())
        for known in known_profiles():
            if known != "cpu" and known in key:
                return get_profile(known)
    return get_profile("h100")


def plan_columns(plan: Plan) -> dict:
    """The plan's hash, prediction and main choices as CellRecord fields."""
    acts = [a for per_layer in plan.activations for a in per_layer]
    levels = {level: sum(a.level is level for a in acts) for level in SavedLevel}
    opt = sorted({lp.optimizer.value for lp in plan.layers},
                 key=[o.value for o in OptimizerWhere].index)
    p, ch = predict_schedule(plan, plan.profile), plan.chunking  # the schedule that will run
    return dict(
        plan_hash=plan.hash, planner_version=plan.planner_version,
        attention_bwd=plan.attention_bwd.value, precision=plan.precision.value,
        predicted_tok_per_s=p.tok_per_s, predicted_model_tflop_per_s=p.model_tflop_per_s,
        predicted_mfu=p.mfu, predicted_hfu=p.hfu, predicted_step_time_s=p.step_time_s,
        predicted_bottleneck=p.bottleneck, chunk_tokens=ch.chunk_tokens,
        chunks_per_round=ch.chunks_per_round, rounds_per_step=ch.rounds_per_step,
        seqs_per_step=ch.seqs_per_step,
        layers_weights_on_device=sum(lp.weights is Where.DEVICE for lp in plan.layers),
        layers_grads_on_device=sum(lp.grads is Where.DEVICE for lp in plan.layers),
        optimizer_where="+".join(opt), grad_accum=plan.grad_accum.value,
        weight_slots=plan.slots.weight_slots, act_slots=plan.slots.act_slots,
        acts_home=sum(a.home is Where.HOME for a in acts),
        acts_inp_only=levels[SavedLevel.INP_ONLY], acts_inp_attn=levels[SavedLevel.INP_ATTN],
        acts_full=levels[SavedLevel.FULL],
        planned_device_bytes=plan.memory.device_bytes, planned_host_bytes=plan.memory.host_bytes)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def base_record(cell: Cell, *, status: Status, backend: str, profile: HardwareProfile,
                steps: int, run_id: str, commit: str | None, **fields) -> CellRecord:
    budget = Budget.from_gib(cell.host_gib, cell.dev_gib)
    return CellRecord(
        model=cell.model, seqlen=cell.seqlen, host_gib=cell.host_gib, dev_gib=cell.dev_gib,
        host_budget_bytes=budget.host_bytes, device_budget_bytes=budget.device_bytes,
        status=status.value, backend=backend, profile=profile.name,
        device_name=fields.pop("device_name", f"{profile.name} (profile)"), commit=commit,
        hostname=socket.gethostname(), run_id=run_id,
        started_at=fields.pop("started_at", now_iso()), steps=steps, **fields)


def lora_flags(lora: Lora | None) -> str | None:
    """The --lora-* flags that give `lora` (the record's lora column), None without LoRA."""
    if lora is None:
        return None
    return (f"--lora-rank {lora.rank} --lora-alpha {lora.alpha:g} "
            f"--lora-targets {lora.spec()}" + (" --lora-base fp8" if lora.fp8_base else ""))


def plan_cell(cell: Cell, profile: HardwareProfile, *, attention_bwd: str = "deterministic",
              precision: str = "bf16", lora: Lora | None = None,
              **common) -> tuple[Plan | None, CellRecord]:
    """(plan, PREDICTED record) when the budgets fit, (None, INFEASIBLE record) when the planner
    refuses them. Other planner errors (unknown model, bad seqlen, LoRA on an MoE model)
    propagate: they are the user's to fix, not a cell's result. The demo runs the plan's JSON,
    which carries its attention backward, precision and LoRA adapters."""
    cfg = model_config(cell.model)
    try:
        plan = make_plan(cfg, cell.seqlen, Budget.from_gib(cell.host_gib, cell.dev_gib), profile,
                         attention_bwd=attention_bwd, precision=precision, lora=lora)
    except InfeasibleBudget as exc:
        return None, base_record(cell, status=Status.INFEASIBLE, profile=profile,
                                 attention_bwd=attention_bwd, precision=precision,
                                 lora=lora_flags(lora),
                                 error=str(exc).strip().splitlines()[-1],
                                 min_device_bytes=exc.min_device_bytes,
                                 min_host_bytes=exc.min_host_bytes, **common)
    return plan, base_record(cell, status=Status.PREDICTED, profile=profile,
                             lora=lora_flags(plan.lora), **plan_columns(plan), **common)
