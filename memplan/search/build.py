"""Turns explicit decisions into a Plan: validate them, lay out the memory map, predict the step,
and refuse budgets they do not fit. Used by the search for its pick and by tests and the executor's
parity tests to force a particular plan. Never imports array libraries, never decides placement."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.decisions import Decisions, decisions_of, validate_decisions
from dataflow.memplan.plan.errors import InfeasibleBudget, categories_text, gib_text
from dataflow.memplan.plan.frozen import as_frozen
from dataflow.memplan.plan.lora import as_lora, base_frozen, refuse_unsupported
from dataflow.memplan.plan.memory import memory_map
from dataflow.memplan.plan.plan import (
    Budget,
    Chunking,
    GradAccum,
    HardwareProfile,
    LayerPlacement,
    Plan,
    Precision,
    SavedActivation,
    Slots,
)
from dataflow.memplan.search.cost import predict
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

PLANNER_VERSION = "memplan-1"


def validate_budget(budget: Budget) -> None:
    for field in ("host_bytes", "device_bytes"):
        value = getattr(budget, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"budget {field} must be a positive number of bytes, got {value!r}")


def finish_plan(d: Decisions, budget: Budget, profile: HardwareProfile) -> Plan:
    """Validate `d`, compute its memory map and prediction, check both budgets."""
    validate_decisions(d)
    validate_budget(budget)
    mem = memory_map(d)
    reserve = profile.library_reserve_bytes
    if mem.device_bytes + reserve > budget.device_bytes or mem.host_bytes > budget.host_bytes:
        over = []
        if mem.device_bytes + reserve > budget.device_bytes:
            over.append(f"device {gib_text(mem.device_bytes + reserve)} GiB > budget "
                        f"{budget.device_bytes / 2**30:.1f} GiB ({categories_text(mem.device)}, "
                        f"library reserve {gib_text(reserve)})")
        if mem.host_bytes > budget.host_bytes:
            over.append(f"host {gib_text(mem.host_bytes)} GiB > budget "
                        f"{budget.host_bytes / 2**30:.1f} GiB ({categories_text(mem.host)})")
        raise InfeasibleBudget(
            f"these decisions for {d.model.name} at seqlen {d.chunking.seqlen} do not fit: "
            f"{'; '.join(over)}. Give at least host {gib_text(mem.host_bytes)} GiB and device "
            f"{gib_text(mem.device_bytes + reserve)} GiB, or choose fewer slots, more activations "
            "at home or lower saved-activation levels.",
            device_needed=mem.device, host_needed=mem.host, min_host_bytes=mem.host_bytes,
            min_device_bytes=mem.device_bytes + reserve, host_budget_bytes=budget.host_bytes,
            device_budget_bytes=budget.device_bytes)
    return Plan(model=d.model, budget=budget, profile=profile, chunking=d.chunking, slots=d.slots,
                layers=d.layers, activations=d.activations, embed=d.embed, head=d.head,
                grad_accum=d.grad_accum, memory=mem, prediction=predict(d, profile),
                planner_version=PLANNER_VERSION, attention_bwd=d.attention_bwd,
                precision=d.precision,
                holds_embed=d.holds_embed, holds_head=d.holds_head, segment_layers=d.segment_layers,
                kv_rebuild=d.kv_rebuild, frozen=d.frozen, lora=d.lora,
                state_parts=d.state_parts)


def build_plan(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile, *,
               chunking: Chunking, slots: Slots, layers: tuple[LayerPlacement, ...] | list,
               activations, embed: LayerPlacement, head: LayerPlacement,
               grad_accum: GradAccum = GradAccum.BF16, kv_rebuild: bool = False,
               precision: Precision = Precision.BF16, frozen=None, lora=None) -> Plan:
    """A Plan from explicit decisions (no search): validates them (placement triples, slot
    counts, chunking shape), computes the memory map and prediction, and raises InfeasibleBudget
    when they do not fit `budget`. `activations[layer][chunk]` is a SavedActivation; `frozen` a
    Frozen or a spec (dataflow.memplan.plan.frozen.parse_freeze); `lora` a Lora (the base is
    then frozen whole: dataflow.memplan.plan.lora)."""
    if chunking.seqlen != seqlen:
        raise ConfigError(f"chunking.seqlen {chunking.seqlen} differs from seqlen {seqlen}")
    acts = tuple(tuple(row) for row in activations)
    for row in acts:
        for a in row:
            if not isinstance(a, SavedActivation):
                raise ConfigError(f"activations must hold SavedActivation entries, got {a!r}")
    d = Decisions(model=cfg, chunking=chunking, slots=slots, layers=tuple(layers),
                  activations=acts, embed=embed, head=head, grad_accum=grad_accum,
                  kv_rebuild=kv_rebuild, precision=Precision(precision),
                  frozen=as_frozen(frozen, cfg.n_layers), lora=as_lora(lora))
    if d.lora is not None:
        refuse_unsupported(cfg, d.lora, precision=d.precision)
        d = dataclasses.replace(d, frozen=base_frozen(cfg))
    return finish_plan(d, budget, profile)


def finish_segment_plan(d, budget, profile):
    """dataflow.memplan.search.build.finish_plan for decisions that may use segments: the memory map and the
    prediction are computed from `d` (segments included); the Plan carries its segment_layers."""
    return dataclasses.replace(finish_plan(d, budget, profile), segment_layers=d.segment_layers)


def with_segments(plan, k: int, budget=None):
    """`plan` (a Plan) with segment_layers k, re-laid out and re-predicted; by default within
    its own budget (raises InfeasibleBudget when the new layout does not fit)."""
    d = dataclasses.replace(decisions_of(plan), segment_layers=k)
    return finish_segment_plan(d, budget or plan.budget, plan.profile)
