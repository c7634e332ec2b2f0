"""The memory map of a plan: the named device and host regions the executor allocates, in a fixed
order, and their totals per category. Built only from memplan/plan/buffers.py and the block layouts,
so the planner's promise and the executor's arenas are the same list. The rules are written out
in docs/planner.md. Never imports array libraries and never decides placement.

Both `device_regions` and `host_regions` accept a Plan or a Decisions (the same field names)."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import any_streamed_optimizer, decisions_of, home_layer_grads
from dataflow.memplan.plan.plan import AttentionBwd, GradAccum, MemoryMap, OptimizerWhere, Where
from dataflow.memplan.plan.lora import region_sizes
from dataflow.memplan.plan.segments import (
    KV_REGION,
    inner_regions,
    is_inner,
    kv_less,
    kv_rebuilt,
    kv_region_bytes,
)

CATEGORIES = ("weights", "grads", "optimizer_state", "saved_activations", "workspaces", "buffers")
_FIXED_CATEGORY = {
    "weight_slots": "weights", "grad_slots": "grads", "act_slots": "saved_activations",
    "workspace": "workspaces", "context": "workspaces", "head_buffers": "workspaces",
    "attn_workspace": "workspaces", "library_scratch": "workspaces", "kv_rebuild": "workspaces",
    "transitions": "buffers", "opt_stage": "buffers", "io_staging": "buffers",
    "tokens": "buffers", "embed_rows": "buffers", "norm_host": "buffers",
    buffers.MOE_HOST_REGION: "buffers",
    "home.ctx_kv": "saved_activations",
    "lora.work": "weights", "lora.base_dequant": "weights",
}
TOKEN_ID_BYTES = 4
TOKEN_STAGING_ROWS = 6
"""Pinned token staging: two buffers (rounds alternate, so the next round stages while this one
runs) of three rows each: ids, RoPE positions, targets."""
NORM_HOST_BYTES = 256
"""Pinned fp32 scalars: the host's part of the squared gradient norm, the clip scale."""


def row_parts(rounds_per_step: int) -> int:
    """Parts (tokens_per_round x model_dim bf16 rows each) of the pinned embedding rows of a HOME
    table at `rounds_per_step` rounds a step: a gather buffer per round in flight, two for
    alternate rounds when a step has more than one (the next round is gathered while this one
    runs), one otherwise. The backward's gradient rows come home into the gather buffer of
    their round, whose rows have left for the device by then (memplan/step/compile.py orders both
    by events)."""
    return 1 if rounds_per_step == 1 else 2


def embed_row_parts(chunking) -> int:
    """row_parts of a chunking's rounds per step."""
    return row_parts(chunking.rounds_per_step)


def embed_rows_bytes(cfg, chunking) -> int:
    """Bytes of the `embed_rows` host region (unaligned)."""
    return embed_row_parts(chunking) * chunking.tokens_per_round * cfg.model_dim * 2


def region_category(name: str) -> str:
    """The memory-map category of a region name ('layer3.m' -> 'optimizer_state')."""
    if name in _FIXED_CATEGORY:
        return _FIXED_CATEGORY[name]
    if name.startswith(("act.", "home.act.")):
        return "saved_activations"
    suffix = name.rsplit(".", 1)[-1]
    return {"weights": "weights", "grads": "grads", "m": "optimizer_state",
            "v": "optimizer_state"}[suffix]


def grad_bpe(grad_accum: GradAccum) -> int:
    """Bytes per gradient element: 2 for bf16 accumulation, 4 for fp32."""
    return buffers.grad_bytes_per_elem(grad_accum.value)


def state_elems(elems: int, state_parts: int) -> int:
    """Elements of a block's m (and of its v) a plan holds: the whole block's, or with
    Plan.state_parts R > 1 the largest of the R replica parts (a split update's)."""
    if state_parts == 1:
        return elems
    # function-local: split imports this module (its memory maps are cut from ours)
    from dataflow.memplan.plan.split import part_numel_max
    return part_numel_max(elems, state_parts)


def _state_regions(prefix: str, placement, elems: int, gbpe: int, where: Where,
                   frozen: bool = False, state_parts: int = 1):
    """weights/grads/m/v regions of one block that live at `where`; a frozen block's weights
    only (Plan.frozen); m / v of one part of `state_parts` (Plan.state_parts)."""
    out = []
    if placement.weights is where:
        out.append((f"{prefix}.weights", elems * 2))
    if frozen:
        return out
    if placement.grads is where:
        out.append((f"{prefix}.grads", elems * gbpe))
    opt_here = (placement.optimizer is OptimizerWhere.DEVICE) == (where is Where.DEVICE)
    if opt_here:
        part = state_elems(elems, state_parts)
        out += [(f"{prefix}.m", part * 2), (f"{prefix}.v", part * 2)]
    return out


def _act_sizes(cfg, tokens: int, lora=None):
    """(level, kv) -> bytes of one saved activation of a chunk of `tokens`, with or without its
    K/V (dataflow.memplan.plan.segments.kv_less says which), with Plan.lora's products at FULL;
    cached per call site."""
    sizes = {}

    def size(level, kv: bool = True) -> int:
        if (level, kv) not in sizes:
            sizes[(level, kv)] = buffers.saved_activation_bytes(cfg, tokens, level, kv, lora)
        return sizes[(level, kv)]
    return size


def device_regions(plan) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of every device region, each size aligned to 256 B, zero-sized ones left
    out, in this order: resident layer state (layer{i}.weights/.grads/.m/.v), weight_slots,
    grad_slots, embed.*, head.weights, head.grads (present unless the plan does not hold the head:
    a ring rank's), head.m/.v, act.{layer}.{chunk}
    (saved activations kept on the device; with segments, the boundary layers' only, then
    act.seg{p}.{chunk} for the rebuilt inner ones), act_slots, workspace, attn_workspace,
    library_scratch, kv_rebuild (a kv_rebuild plan's), context, transitions, head_buffers,
    lora.weights/.grads/.m/.v/.work (a LoRA plan's; lora.base_dequant too with an fp8 base,
    whose layer blocks are then its codes and row scales: buffers.block_elems), opt_stage."""
    d = decisions_of(plan)
    cfg, ch, s = d.model, d.chunking, d.slots
    elems = buffers.block_elems(cfg, d.lora)
    gbpe = grad_bpe(d.grad_accum)
    out: list[tuple[str, int]] = []
    fz = d.frozen
    for i, p in enumerate(d.layers):
        out += _state_regions(f"layer{i}", p, elems["layer"], gbpe, Where.DEVICE, fz.layer(i),
                              d.state_parts)
    if any(p.weights is Where.HOME for p in d.layers):
        out.append(("weight_slots", s.weight_slots * elems["layer"] * 2))
    if home_layer_grads(d):
        out.append(("grad_slots", s.grad_slots * elems["layer"] * gbpe))
    if d.holds_embed:
        out += _state_regions("embed", d.embed, elems["embed"], gbpe, Where.DEVICE, fz.embed)
    if d.holds_head:
        out.append(("head.weights", elems["head"] * 2))
        if not fz.head:
            out.append(("head.grads", elems["head"] * gbpe))
        if d.head.optimizer is OptimizerWhere.DEVICE and not fz.head:
            part = state_elems(elems["head"], d.state_parts)
            out += [("head.m", part * 2), ("head.v", part * 2)]
    t = ch.chunk_tokens
    act_bytes = _act_sizes(cfg, t, d.lora)
    # Slots are sized with a segment boundary's K/V although it sends them to home.ctx_kv (the
    # schedule's slots need less): kept so, plans and their hashes stay as they were.
    rebuilt = kv_rebuilt(d)
    home_max = 0
    for layer, row in enumerate(d.activations):
        for chunk, a in enumerate(row):
            nb = act_bytes(a.level, kv=(layer, chunk) not in rebuilt)
            if a.home is Where.HOME:
                home_max = max(home_max, nb)
            elif not is_inner(layer, d.segment_layers):
                out.append((f"act.{layer}.{chunk}", nb))
    out += inner_regions(d, act_bytes)[0]
    out.append(("act_slots", s.act_slots * home_max))
    out.append(("workspace", buffers.packed_bytes(buffers.chunk_workspace_specs(
        cfg, t, d.precision))))
    out.append(("attn_workspace", buffers.attention_workspace_bytes(
        cfg, t, ch.seqlen, deterministic=d.attention_bwd is AttentionBwd.DETERMINISTIC)))
    out.append(("library_scratch", buffers.packed_bytes(buffers.library_scratch_specs(cfg))))
    if d.kv_rebuild:
        out.append(("kv_rebuild", buffers.packed_bytes(buffers.kv_rebuild_specs(cfg, t))))
    out.append(("context", buffers.packed_bytes(buffers.context_specs(
        cfg, ch.seqlen, t, ch.chunks_per_seq))))
    out.append(("transitions", buffers.packed_bytes(buffers.transition_specs(
        cfg, ch.tokens_per_round))))
    if d.holds_head:
        out.append(("head_buffers", buffers.packed_bytes(buffers.head_specs(
            cfg, t, s.head_sub_tokens))))
    # fp32 adapters, their gradients and AdamW state, their bf16 working copy (Plan.lora)
    out += list(region_sizes(cfg, d.lora, t).items())
    if any_streamed_optimizer(d):
        gdt = "bf16" if d.grad_accum is GradAccum.BF16 else "f32"
        out.append(("opt_stage", buffers.packed_bytes(buffers.opt_stage_specs(
            s.opt_stage_elems, gdt))))
    return tuple((name, buffers.align(n)) for name, n in out if n > 0)


def host_regions(plan) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of every pinned host region, aligned and in this order: home state of each
    layer whose weights are HOME (home.layer{i}.weights/.grads/.m/.v), home.embed.*,
    home.head.*, home.act.{layer}.{chunk} (with segments: boundary layers', then
    home.act.seg{p}.{chunk}), io_staging, tokens, norm_host, embed_rows, moe_offsets_host (an
    MoE model's: buffers.MOE_HOST_REGION)."""
    d = decisions_of(plan)
    cfg, ch = d.model, d.chunking
    elems = buffers.block_elems(cfg, d.lora)
    gbpe = grad_bpe(d.grad_accum)
    out: list[tuple[str, int]] = []
    fz = d.frozen
    for i, p in enumerate(d.layers):
        out += _state_regions(f"home.layer{i}", p, elems["layer"], gbpe, Where.HOME,
                              fz.layer(i), d.state_parts)
    if d.holds_embed:
        out += _state_regions("home.embed", d.embed, elems["embed"], gbpe, Where.HOME, fz.embed)
    if d.holds_head:
        out += _state_regions("home.head", d.head, elems["head"], gbpe, Where.HOME, fz.head,
                              d.state_parts)
    act_bytes = _act_sizes(cfg, ch.chunk_tokens, d.lora)
    no_kv = kv_less(d)
    for layer, row in enumerate(d.activations):
        for chunk, a in enumerate(row):
            if a.home is Where.HOME and not is_inner(layer, d.segment_layers):
                out.append((f"home.act.{layer}.{chunk}",
                            act_bytes(a.level, kv=(layer, chunk) not in no_kv)))
    out += inner_regions(d, act_bytes)[1]
    out.append((KV_REGION, kv_region_bytes(d)))
    held = [elems["layer"]] + [elems["embed"]] * d.holds_embed + [elems["head"]] * d.holds_head
    out.append(("io_staging", max(held) * 2))
    out.append(("tokens", TOKEN_STAGING_ROWS * ch.tokens_per_round * TOKEN_ID_BYTES))
    out.append(("norm_host", NORM_HOST_BYTES))
    if d.embed.weights is Where.HOME and d.holds_embed:
        out.append(("embed_rows", embed_rows_bytes(cfg, ch)))
    if cfg.moe is not None:
        out.append((buffers.MOE_HOST_REGION, (cfg.moe.n_experts + 1) * buffers.DTYPE_BYTES["i64"]))
    return tuple((name, buffers.align(n)) for name, n in out if n > 0)


def by_category(regions) -> tuple[tuple[str, int], ...]:
    totals = dict.fromkeys(CATEGORIES, 0)
    for name, nbytes in regions:
        totals[region_category(name)] += nbytes
    return tuple(totals.items())


def memory_map(plan) -> MemoryMap:
    """Bytes per category on device and host (all six categories, fixed order)."""
    return MemoryMap(device=by_category(device_regions(plan)), host=by_category(host_regions(plan)))


OVERLAP_ROWS_REGION = "overlap.rows"
"""The second set of a round's rows (the residual pair, ids, targets, positions) an overlapped
ring rank's odd rounds use (dataflow.memplan.step.ring_rounds)."""


def overlap_row_specs(cfg, round_tokens: int) -> tuple:
    """The round rows the odd rounds of an overlapped ring take from OVERLAP_ROWS_REGION: the
    first five transition specs (resid_a, resid_b, ids, targets, positions), by the same names."""
    specs = buffers.transition_specs(cfg, round_tokens)[:5]
    assert [s.name for s in specs] == list(buffers.ROUND_ROWS)
    return specs


def overlap_regions(plan, depth: int) -> tuple[tuple[str, int], ...]:
    """The device regions an overlapped ring rank holds beside its plan's (RankPlan.round_overlap
    = `depth` local layers of the next round run during this round's drain): the odd rounds'
    round rows and, for each of the first `depth` layers' chunks whose saved activation the plan
    keeps on the device, a second act.{layer}.{chunk} of the same bytes ('overlap.act...'; the
    odd rounds' of those layers). The planner takes their bytes out of the rank's device budget
    (dataflow.memplan.search.ring_overlap.overlap_bytes) and the executor allocates exactly these:
    one list for both. () for depth 0."""
    if depth <= 0:
        return ()
    d = decisions_of(plan)
    rows = buffers.packed_bytes(overlap_row_specs(d.model, d.chunking.tokens_per_round))
    hoisted = {f"act.{layer}." for layer in range(min(depth, d.model.n_layers))}
    acts = [(f"overlap.{name}", nb) for name, nb in device_regions(plan)
            if name.startswith("act.") and name[:name.rindex(".") + 1] in hoisted]
    return ((OVERLAP_ROWS_REGION, rows),) + tuple(acts)


ODD_ROWS = "@1"
"""The suffix of an overlapped ring rank's odd rounds' row names ('resid_a@1', 'ids@1')."""


def round_row_name(name: str, rnd: int, odd_rows: bool) -> str:
    """The name round `rnd` reads for the round row `name` (buffers.ROUND_ROWS): with a second
    set (`odd_rows`, OVERLAP_ROWS_REGION) the odd rounds' own, else the one set's. The compiler
    (dataflow.memplan.step.ring_rounds) and the executor name rows by this one rule."""
    return name + ODD_ROWS if odd_rows and rnd % 2 and name in buffers.ROUND_ROWS else name
