"""The decisions of a plan without its budget, memory map or prediction, and the rules every set
of decisions must obey (chunking shapes, placement triples, slot counts). memory.py and cost.py
read either a `Decisions` or a `Plan` (same field names). Never imports array libraries."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.frozen import NOTHING_FROZEN, Frozen
from dataflow.memplan.plan.lora import Lora
from dataflow.memplan.plan.plan import (
    AttentionBwd,
    Chunking,
    GradAccum,
    LayerPlacement,
    OptimizerWhere,
    Precision,
    SavedActivation,
    Slots,
    Where,
)
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

ALLOWED_PLACEMENTS = (
    (Where.DEVICE, Where.DEVICE, OptimizerWhere.DEVICE),
    (Where.HOME, Where.HOME, OptimizerWhere.STREAMED),
    (Where.HOME, Where.HOME, OptimizerWhere.HOST),
)
"""(weights, grads, optimizer) triples a layer, the embedding or the head may take."""

RESIDENT = LayerPlacement(weights=Where.DEVICE, grads=Where.DEVICE, optimizer=OptimizerWhere.DEVICE)
HOME_STREAMED = LayerPlacement(weights=Where.HOME, grads=Where.HOME,
                               optimizer=OptimizerWhere.STREAMED)
HOME_HOST = LayerPlacement(weights=Where.HOME, grads=Where.HOME, optimizer=OptimizerWhere.HOST)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decisions:
    """What the search decides; a Plan adds budget, profile, memory map and prediction."""

    model: ModelConfig
    chunking: Chunking
    slots: Slots
    layers: tuple[LayerPlacement, ...]
    activations: tuple[tuple[SavedActivation, ...], ...]
    """activations[layer][chunk] for every chunk of a round."""
    embed: LayerPlacement
    head: LayerPlacement
    grad_accum: GradAccum
    segment_layers: int = 1
    """See Plan.segment_layers."""
    attention_bwd: AttentionBwd = AttentionBwd.DETERMINISTIC
    """See Plan.attention_bwd."""
    holds_embed: bool = True
    """See Plan.holds_embed."""
    holds_head: bool = True
    """See Plan.holds_head."""
    kv_rebuild: bool = False
    """See Plan.kv_rebuild."""
    precision: Precision = Precision.BF16
    """See Plan.precision."""
    frozen: Frozen = NOTHING_FROZEN
    """See Plan.frozen."""
    lora: Lora | None = None
    """See Plan.lora."""
    state_parts: int = 1
    """See Plan.state_parts."""
    whole_update_cost: bool = False
    """With state_parts R > 1: the cost model charges AdamW for the whole layers and head, as
    if unsplit (the search's scoring before it charged the part; dataflow.memplan.search.layout
    weighs both). Not a Plan field: only its prediction depends on it."""


def decisions_of(obj) -> Decisions:
    """The Decisions of a Plan (or a Decisions itself)."""
    if isinstance(obj, Decisions):
        return obj
    return Decisions(model=obj.model, chunking=obj.chunking, slots=obj.slots, layers=obj.layers,
                     activations=obj.activations, embed=obj.embed, head=obj.head,
                     grad_accum=obj.grad_accum, segment_layers=obj.segment_layers,
                     attention_bwd=obj.attention_bwd, holds_embed=obj.holds_embed,
                     holds_head=obj.holds_head, kv_rebuild=obj.kv_rebuild,
                     precision=obj.precision, frozen=obj.frozen, lora=obj.lora,
                     state_parts=obj.state_parts)


def _positive(where: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")


def validate_chunking(ch: Chunking) -> None:
    """Packing (seqlen <= chunk_tokens: whole sequences per chunk) or splitting (a sequence
    spans chunks_per_seq chunks); a round holds whole sequences."""
    for field in ("seqlen", "chunk_tokens", "seqs_per_chunk", "chunks_per_seq",
                  "chunks_per_round", "rounds_per_step"):
        _positive(f"chunking.{field}", getattr(ch, field))
    if ch.seqlen <= ch.chunk_tokens:
        if ch.chunks_per_seq != 1 or ch.chunk_tokens != ch.seqs_per_chunk * ch.seqlen:
            raise ConfigError(
                f"chunking packs sequences (seqlen {ch.seqlen} <= chunk_tokens "
                f"{ch.chunk_tokens}) so chunk_tokens must equal seqs_per_chunk x seqlen and "
                f"chunks_per_seq must be 1; got seqs_per_chunk {ch.seqs_per_chunk}, "
                f"chunks_per_seq {ch.chunks_per_seq}")
    else:
        if ch.seqs_per_chunk != 1 or ch.seqlen != ch.chunks_per_seq * ch.chunk_tokens:
            raise ConfigError(
                f"chunking splits sequences (seqlen {ch.seqlen} > chunk_tokens "
                f"{ch.chunk_tokens}) so seqlen must equal chunks_per_seq x chunk_tokens and "
                f"seqs_per_chunk must be 1; got chunks_per_seq {ch.chunks_per_seq}, "
                f"seqs_per_chunk {ch.seqs_per_chunk}; pick a chunk_tokens that divides "
                f"{ch.seqlen}")
        if ch.chunks_per_round % ch.chunks_per_seq:
            raise ConfigError(
                f"chunks_per_round {ch.chunks_per_round} must be a multiple of chunks_per_seq "
                f"{ch.chunks_per_seq} (a round holds whole sequences)")


def _check_placement(where: str, p: LayerPlacement) -> None:
    if (p.weights, p.grads, p.optimizer) not in ALLOWED_PLACEMENTS:
        allowed = "; ".join(f"({w.value}, {g.value}, {o.value})" for w, g, o in ALLOWED_PLACEMENTS)
        raise ConfigError(f"{where} placement ({p.weights.value}, {p.grads.value}, "
                          f"{p.optimizer.value}) is not allowed; (weights, grads, optimizer) "
                          f"must be one of: {allowed}")


def _check_tied(d: Decisions) -> None:
    """A tied embedding (ModelConfig.tie_embeddings) is one parameter that the embedding's
    lookup and the head's matmul both read and add gradients into, on the device: its block is
    RESIDENT, and one plan holds both uses (a ring of 2+ ranks would split them)."""
    cfg = d.model
    if not cfg.tie_embeddings:
        return
    if d.holds_embed != d.holds_head:
        raise ConfigError(f"model '{cfg.name}' ties its head to the embedding, so one plan must "
                          f"hold both (holds_embed {d.holds_embed}, holds_head {d.holds_head}); "
                          "train it on one device or as data-parallel replicas (rings of 1)")
    if d.holds_embed and d.embed != RESIDENT:
        p = d.embed
        raise ConfigError(f"model '{cfg.name}' ties its head to the embedding, whose table the "
                          "head reads and adds its gradient into on the device, so the "
                          "embedding must be resident (device, device, device), not "
                          f"({p.weights.value}, {p.grads.value}, {p.optimizer.value})")


def refuse_moe(cfg: ModelConfig, *, holds_embed: bool = True, holds_head: bool = True) -> None:
    """The planner's limits on a mixture-of-experts config (ModelConfig.moe): every expert moves
    with its layer's block, on one device, in data-parallel replicas and on a ring rank (a plan
    that holds neither the embedding nor the head: the ring passes the round's routing totals
    between its ranks, dataflow.memplan.step.ring_compile); shared experts are refused, which have
    no engine ops. make_plan calls it first and validate_decisions again (Engine.from_plan's
    hand-made plans too). Raises ConfigError. holds_embed / holds_head are accepted for the
    callers' sake and no longer limit anything."""
    m = cfg.moe
    if m is None:
        return
    what = f"model '{cfg.name}' ({cfg.family}, {m.n_experts} experts, top {m.top_k})"
    if m.n_shared_experts:
        raise ConfigError(f"{what} has {m.n_shared_experts} shared expert(s), which the engine "
                          "has no ops for (neither OLMoE nor Qwen3-MoE has one); train it on "
                          "dataflow.reference_trainer.ReferenceTrainer, or set "
                          "n_shared_experts 0")


def trained_placements(d: Decisions) -> list[LayerPlacement]:
    """The placements of the blocks that train (layers, embedding, head; not the frozen ones,
    whose placement counts for their weights only: Plan.frozen)."""
    f = d.frozen
    return [p for i, p in enumerate(d.layers) if not f.layer(i)] + [d.embed] * (not f.embed) \
        + [d.head] * (not f.head)


def any_streamed_optimizer(d: Decisions) -> bool:
    return any(p.optimizer is OptimizerWhere.STREAMED for p in trained_placements(d))


def home_layer_grads(d: Decisions) -> bool:
    """Whether a trained layer's gradients stream through grad slots."""
    return any(p.grads is Where.HOME for i, p in enumerate(d.layers) if not d.frozen.layer(i))


def _check_frozen(d: Decisions) -> None:
    """Frozen layers exist; an MoE layer is not frozen (its expert ops have no path without
    weight gradients yet); a tied embedding and head freeze together (one parameter)."""
    f, cfg = d.frozen, d.model
    if not isinstance(f, Frozen):
        raise ConfigError(f"frozen must be a Frozen, got {type(f).__name__}; use "
                          "dataflow.memplan.plan.frozen.parse_freeze")
    f.check(cfg.n_layers)
    if f.layers and cfg.moe is not None:
        raise ConfigError(f"model '{cfg.name}' is a mixture of experts, whose layers cannot be "
                          f"frozen yet (layers {f.spec()}); freeze only embed and head")
    if f.embed and f.head and len(f.layers) == cfg.n_layers and d.lora is None:
        raise ConfigError(f"freeze '{f.spec()}' freezes every block of model '{cfg.name}', so "
                          "nothing would train; leave at least one block out (e.g. "
                          f"layers:0-{cfg.n_layers - 2} keeps the last layer training)")
    if cfg.tie_embeddings and f.embed != f.head:
        raise ConfigError(f"model '{cfg.name}' ties its head to the embedding (one parameter), "
                          "so freeze both or neither: add embed,head to the spec or drop both")


def validate_decisions(d: Decisions) -> None:
    """Raise ConfigError naming the first rule `d` breaks."""
    cfg, ch, s = d.model, d.chunking, d.slots
    validate_chunking(ch)
    if len(d.layers) != cfg.n_layers:
        raise ConfigError(f"plan has {len(d.layers)} layer placements; model '{cfg.name}' has "
                          f"{cfg.n_layers} layers")
    for i, p in enumerate(d.layers):
        _check_placement(f"layer {i}", p)
    _check_placement("embed", d.embed)
    _check_placement("head", d.head)
    refuse_moe(cfg, holds_embed=d.holds_embed, holds_head=d.holds_head)
    _check_tied(d)
    _check_frozen(d)
    if len(d.activations) != cfg.n_layers or any(len(row) != ch.chunks_per_round
                                                 for row in d.activations):
        raise ConfigError(f"activations must be {cfg.n_layers} rows (layers) of "
                          f"{ch.chunks_per_round} entries (chunks per round)")
    for field in ("weight_slots", "grad_slots", "act_slots", "opt_stage_elems"):
        value = getattr(s, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"slots.{field} must be a non-negative integer, got {value!r}")
    needs = (("weight_slots", any(p.weights is Where.HOME for p in d.layers), "layer weights"),
             ("grad_slots", home_layer_grads(d), "layer grads"),
             ("act_slots", any(a.home is Where.HOME for row in d.activations for a in row),
              "saved activations"),
             ("opt_stage_elems", any_streamed_optimizer(d), "optimizer states STREAMED"))
    for field, used, what in needs:
        if used and getattr(s, field) < 1:
            raise ConfigError(f"slots.{field} is 0 but some {what} live at home; use at least "
                              "1 (1 means no prefetch overlap)")
    k = d.segment_layers
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.n_layers:
        raise ConfigError(f"segment_layers must be in 1..{cfg.n_layers} (1: no segments), "
                          f"got {k!r}")
    if d.kv_rebuild is not False and (d.kv_rebuild is not True or ch.chunks_per_seq < 2
                                      or k > 1):
        raise ConfigError(f"kv_rebuild {d.kv_rebuild!r} needs split sequences (chunks_per_seq "
                          f"{ch.chunks_per_seq}) and no segments (segment_layers {k}); use "
                          "kv_rebuild=False")
    _positive("slots.head_sub_tokens", s.head_sub_tokens)
    if s.head_sub_tokens > ch.chunk_tokens or ch.chunk_tokens % s.head_sub_tokens:
        raise ConfigError(f"slots.head_sub_tokens {s.head_sub_tokens} must divide chunk_tokens "
                          f"{ch.chunk_tokens}")
