"""Layer-segment recompute, the planner's side: a plan with `segment_layers` k > 1 keeps the
saved activations of every k-th layer (the segment's first, its *boundary*) from the forward to
the backward; the backward rebuilds the others (the segment's *inner* layers) by re-running the
segment's forward from the boundary, chunk by chunk, into storage reused by every segment
(`act.seg{p}.{chunk}` on the device, `home.act.seg{p}.{chunk}` at home, p = layer - boundary).
This module names the segments and that storage; memory.py, cost.py and schedule.py use it.
Pure Python: never imports array libraries."""

from __future__ import annotations

from memplan.plan import Where


def segment_bounds(n_layers: int, k: int) -> tuple[tuple[int, int], ...]:
    """(first, end) layers of each segment in forward order; k = 1 gives one per layer."""
    return tuple((s, min(s + k, n_layers)) for s in range(0, n_layers, k))


def is_inner(layer: int, k: int) -> bool:
    """Whether `layer`'s saved activation is rebuilt in the backward rather than kept."""
    return k > 1 and layer % k != 0


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


def finish_segment_plan(d, budget, profile):
    """memplan.build.finish_plan for decisions that may use segments: the memory map and the
    prediction are computed from `d` (segments included); the Plan carries its segment_layers."""
    import dataclasses

    from memplan.build import finish_plan

    return dataclasses.replace(finish_plan(d, budget, profile), segment_layers=d.segment_layers)


def with_segments(plan, k: int, budget=None):
    """`plan` (a Plan) with segment_layers k, re-laid out and re-predicted; by default within
    its own budget (raises InfeasibleBudget when the new layout does not fit)."""
    import dataclasses

    from memplan.decisions import decisions_of

    d = dataclasses.replace(decisions_of(plan), segment_layers=k)
    return finish_segment_plan(d, budget or plan.budget, plan.profile)
