"""The part arithmetic of a split update (RankPlan.split_update, docs/ring.md "Split updates"):
every block is cut into fixed sub-blocks of SUB_BLOCK elements, and replica q of R owns a
contiguous run of whole sub-blocks, balanced over the replicas. The same cut serves the squared
gradient norm (dataflow.norm_parts sums each sub-block, then adds the sums exactly), so the norm
does not depend on R. Pure Python integers: never imports array libraries, never decides
whether an update is split."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.memory import by_category, device_regions, host_regions
from dataflow.memplan.plan.plan import MemoryMap

SUB_BLOCK = 1024
"""Elements per sub-block: the unit of the exact squared norm and of every replica's part."""


def sub_blocks(numel: int) -> int:
    """How many sub-blocks a block of `numel` elements has (the last may be short)."""
    return -(-numel // SUB_BLOCK)


def part_bounds(numel: int, replicas: int) -> tuple[int, ...]:
    """The R + 1 element offsets 0 = b_0 <= b_1 <= ... <= b_R = numel: replica q owns elements
    [b_q, b_{q+1}), sub-blocks [q S // R, (q + 1) S // R) of the S = sub_blocks(numel)."""
    if replicas < 1:
        raise ValueError(f"{replicas} replicas: use 1 or more")
    s = sub_blocks(numel)
    return tuple(min(numel, (q * s // replicas) * SUB_BLOCK) for q in range(replicas + 1))


def part_range(numel: int, replicas: int, q: int) -> tuple[int, int]:
    """Replica q's elements [lo, hi) of a block of `numel` elements."""
    b = part_bounds(numel, replicas)
    return b[q], b[q + 1]


def part_numel_max(numel: int, replicas: int) -> int:
    """The most elements any replica's part holds (what one replica's AdamW state must fit)."""
    b = part_bounds(numel, replicas)
    return max(hi - lo for lo, hi in zip(b, b[1:]))


def part_byte_bounds(nbytes: int, bpe: int, replicas: int) -> tuple[int, ...]:
    """part_bounds of a block of nbytes / bpe elements, in bytes (`bpe` bytes an element)."""
    if nbytes % bpe:
        raise ValueError(f"{nbytes} bytes are not whole elements of {bpe} bytes")
    return tuple(b * bpe for b in part_bounds(nbytes // bpe, replicas))


STATE_PARTS = (".m", ".v")
"""The suffixes of the AdamW state regions a split replica holds for its part alone."""


def state_part_regions(regions, numel: dict[str, int], replicas: int, align) -> tuple:
    """`regions` ((name, bytes), dataflow.memplan.plan.memory's lists) with the m / v regions
    of the blocks in `numel` (region prefix 'layer3' / 'head' -> elements) cut to the largest
    replica part (bf16, `align`ed): what one replica of a split update allocates. The embedding
    (not in `numel`) keeps its whole state."""
    out = []
    for name, nbytes in regions:
        base = name.removeprefix("home.")
        stem, dot, suffix = base.rpartition(".")
        if dot and "." + suffix in STATE_PARTS and stem in numel:
            nbytes = align(part_numel_max(numel[stem], replicas) * 2)
        out.append((name, nbytes))
    return tuple(out)


def split_state_numel(plan) -> dict[str, int]:
    """The region prefixes of the blocks a split update cuts ('layer0'.., 'head') -> elements:
    every layer and the head of `plan` (a ring rank's own), not the embedding."""
    elems = buffers.block_elems(plan.model)
    out = {f"layer{i}": elems["layer"] for i in range(len(plan.layers))}
    out["head"] = elems["head"]
    return out


def split_memory_map(plan, replicas: int) -> MemoryMap:
    """The memory map of one replica of a split update over `replicas` (m / v of the layers and
    the head for its part only): the bytes the planner counts for such a replica."""
    numel = split_state_numel(plan)
    dev = state_part_regions(device_regions(plan), numel, replicas, buffers.align)
    host = state_part_regions(host_regions(plan), numel, replicas, buffers.align)
    return MemoryMap(device=by_category(dev), host=by_category(host))
