"""Layer-segment recompute, the planner's side: a plan with `segment_layers` k > 1 keeps the
saved activations of every k-th layer (the segment's first, its *boundary*) from the forward to
the backward; the backward rebuilds the others (the segment's *inner* layers) by re-running the
segment's forward from the boundary, chunk by chunk, into storage reused by every segment
(`act.seg{p}.{chunk}` on the device, `home.act.seg{p}.{chunk}` at home, p = layer - boundary).
This module names the segments and that storage; memory.py, cost.py and schedule.py use it.

Split sequences: a boundary kept at home at INP_ONLY keeps no K/V (`shares_boundary_kv`). The
recompute re-forms them in the context buffer anyway (the boundary's forward re-run), and sends
them to one host region, `home.ctx_kv` (a round's K and V rows, reused by every segment), from
which the boundary's backward refills its context. At 8b with 524,288 tokens that keeps 2 GiB
instead of 15 GiB of boundary K/V. A plan with `kv_rebuild` (no segments) goes further: every
INP_ONLY or INP_ATTN activation of a split sequence keeps no K/V, and the backward re-forms each
chunk's K/V from its saved input x (`rebuilds_kv`). Pure Python: never imports array
libraries."""

from __future__ import annotations

from dataflow.memplan.plan.plan import Where
from dataflow.models.flops import SavedLevel

KV_REGION = "home.ctx_kv"
"""K rows then V rows of a round's tokens, for the boundary whose segment is being recomputed."""


def segment_bounds(n_layers: int, k: int) -> tuple[tuple[int, int], ...]:
    """(first, end) layers of each segment in forward order; k = 1 gives one per layer."""
    return tuple((s, min(s + k, n_layers)) for s in range(0, n_layers, k))


def is_inner(layer: int, k: int) -> bool:
    """Whether `layer`'s saved activation is rebuilt in the backward rather than kept."""
    return k > 1 and layer % k != 0


def shares_boundary_kv(d, layer: int, chunk: int) -> bool:
    """Whether (layer, chunk)'s saved activation leaves its K/V to KV_REGION: a split sequence's
    boundary of a segment of two or more layers (so a recompute re-forms its K/V), kept at home
    at INP_ONLY. `d`: a Plan or Decisions."""
    k = getattr(d, "segment_layers", 1)
    if k <= 1 or d.chunking.chunks_per_seq <= 1 or layer % k or \
            layer + 1 >= len(d.activations):
        return False
    a = d.activations[layer][chunk]
    return a.home is Where.HOME and a.level is SavedLevel.INP_ONLY


def boundary_kv_sharers(d) -> frozenset[tuple[int, int]]:
    """Every (layer, chunk) of `d` for which shares_boundary_kv holds."""
    return frozenset((layer, c) for layer, row in enumerate(d.activations)
                     for c in range(len(row)) if shares_boundary_kv(d, layer, c))


REBUILT_KV_LEVELS = (SavedLevel.INP_ONLY, SavedLevel.INP_ATTN)
"""Levels whose K/V a Plan.kv_rebuild plan re-forms in the backward instead of keeping."""


def rebuilds_kv(d, layer: int, chunk: int) -> bool:
    """Whether the backward re-forms (layer, chunk)'s K/V from its saved input x (Plan.kv_rebuild:
    a split sequence's INP_ONLY and INP_ATTN activations keep no K/V)."""
    return getattr(d, "kv_rebuild", False) and \
        d.activations[layer][chunk].level in REBUILT_KV_LEVELS


def kv_rebuilt(d) -> frozenset[tuple[int, int]]:
    """Every (layer, chunk) of `d` for which rebuilds_kv holds."""
    if not getattr(d, "kv_rebuild", False):
        return frozenset()
    return frozenset((layer, c) for layer, row in enumerate(d.activations)
                     for c in range(len(row)) if rebuilds_kv(d, layer, c))


def kv_less(d) -> frozenset[tuple[int, int]]:
    """Every (layer, chunk) whose saved activation keeps no K/V: segment boundaries that share
    KV_REGION and the activations a kv_rebuild plan re-forms."""
    return boundary_kv_sharers(d) | kv_rebuilt(d)


def kv_region_nbytes(cfg, chunking) -> int:
    """Bytes of KV_REGION when it exists: a round's K rows, then its V rows, bf16."""
    return 2 * chunking.tokens_per_round * cfg.n_kv_heads * cfg.head_dim * 2


def kv_region_bytes(d) -> int:
    """Bytes of KV_REGION for `d`, 0 when no saved activation shares its K/V."""
    return kv_region_nbytes(d.model, d.chunking) if boundary_kv_sharers(d) else 0


def inner_region(layer: int, chunk: int, k: int, home: Where) -> str:
    """The region an inner layer's rebuilt activation lives in (shared across segments)."""
    prefix = "home.act" if home is Where.HOME else "act"
    return f"{prefix}.seg{layer % k}.{chunk}"


def inner_regions(d, act_bytes) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(device, host) regions of a plan's rebuilt inner activations: one per (position in the
    segment, chunk) and place, sized for the largest level any segment keeps there.
    `act_bytes(level)` gives a level's bytes."""
    k = getattr(d, "segment_layers", 1)
    sizes: dict[tuple[Where, int, int], int] = {}
    for layer, row in enumerate(d.activations):
        if not is_inner(layer, k):
            continue
        for chunk, a in enumerate(row):
            key = (a.home, layer % k, chunk)
            sizes[key] = max(sizes.get(key, 0), act_bytes(a.level))
    out = {Where.DEVICE: [], Where.HOME: []}
    for (home, pos, chunk), nbytes in sorted(sizes.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        out[home].append((inner_region(pos, chunk, k, home), nbytes))
    return out[Where.DEVICE], out[Where.HOME]
