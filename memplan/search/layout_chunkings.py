"""The chunk shapes memplan.search.layout weighs beside the planner's own for a layout: full
rings (at least as many chunks a round as ranks, at the planner's chunk size and smaller) and,
for replicas of one device of a capped batch, fewer and fuller rounds and fewer resident
layers. Shapes only, as constraint dicts: never plans, never predicts."""

from __future__ import annotations

import math

FULL_RING_SPLITS = (2, 4)
"""The planner's chunk is also weighed cut into this many pieces for a full ring."""
MIN_RING_CHUNK_TOKENS = 1024
"""No ring chunk shorter: below it the layers' GEMMs lose their arithmetic intensity (the cost
model charges it, but the search need not spend time there)."""
FULL_RING_MULTIPLES = (1, 2)
"""Chunks a round weighed for a full ring, as multiples of the ring size."""

FEWER_ROUNDS_FROM = 4
"""A replica (ring of one) of a capped batch with 2 to this many rounds a step is weighed with its
sequences in fewer, fuller rounds too (fewer_rounds_shapes)."""


def full_ring_chunkings(ch, n: int, constraints: dict, *, few: bool = False) -> list[dict]:
    """The chunk shapes weighed beside the planner's own `ch` for a ring of n: at least n chunks
    a round (a full ring: every rank has a chunk to work on while the others pass theirs on), at
    the planner's chunk size and at FULL_RING_SPLITS of it (down to MIN_RING_CHUNK_TOKENS and not
    where the caller fixed chunk_tokens), with FULL_RING_MULTIPLES of n chunks a round (more
    chunks shorten the pipeline's fill and drain against the round's work, smaller ones fill a
    ring whose memory holds few chunks: 32b at 8k on 2 GPUs at 120 / 40 holds one chunk of 8k
    a round but two of 4k). A shape equal to the planner's is left out. `few` (a placement
    other than cyclic, never predicted ahead of it where a full ring fits) weighs only the
    planner's chunk size with its chunks a round rounded up to a multiple of n, if that is a
    change: each shape is a plan of every rank (0.5 s for 8b)."""
    fixed_c = "chunks_per_round" in constraints
    if few:
        c = math.lcm(ch.chunks_per_round, n)
        return [] if fixed_c or c == ch.chunks_per_round else [{"chunks_per_round": c}]
    sizes = [ch.chunk_tokens]
    if "chunk_tokens" not in constraints:
        sizes += [ch.chunk_tokens // k for k in FULL_RING_SPLITS
                  if ch.chunk_tokens % k == 0 and ch.chunk_tokens // k >= MIN_RING_CHUNK_TOKENS]
    shapes = []
    for tokens in sizes:
        per_seq = max(1, ch.seqlen // tokens) if tokens < ch.seqlen else 1
        counts = ({constraints["chunks_per_round"]} if fixed_c else
                  {math.lcm(m * n, per_seq) for m in FULL_RING_MULTIPLES}
                  | {math.lcm(ch.chunks_per_round, n, per_seq)})
        for c in sorted(counts):
            if (tokens, c) == (ch.chunk_tokens, ch.chunks_per_round) or (fixed_c and c < n):
                continue
            shape = {"chunks_per_round": c}
            if tokens != ch.chunk_tokens:
                shape["chunk_tokens"] = tokens
            shapes.append(shape)
    return shapes


def fewer_rounds_shapes(ch, constraints: dict) -> list[dict]:
    """The chunk shapes a replica of one device (a ring of one) of a capped global batch is
    weighed with beside the planner's chunking `ch`: k times its chunks a round for each k > 1
    dividing its rounds, where it has 2 to FEWER_ROUNDS_FROM rounds a step and the caller fixed
    neither the chunks a round nor left the batch uncapped. The planner's chunking comes from
    the search's per-round estimate, which charges each round as a middle one; with a round or
    two a step the first round's fetches and the update are much of the step, and the compiled
    figures that choose replicas (layout_final) rate the shapes differently (8b at 80 / 24 on the
    h100 profile as one of 64 split replicas, 16,384 tokens a step: 2 rounds of one chunk
    2.155 s, one round of two 2.049 s)."""
    if "chunks_per_round" in constraints or "tokens_per_step" not in constraints or \
            not 1 < ch.rounds_per_step <= FEWER_ROUNDS_FROM:
        return []
    return [{"chunks_per_round": ch.chunks_per_round * k}
            for k in range(2, ch.rounds_per_step + 1) if ch.rounds_per_step % k == 0]


def fewer_resident_shapes(ch, resident: int, constraints: dict) -> list[dict]:
    """The resident-layer caps a replica of one device (a ring of one) of a capped global batch
    with 1 to FEWER_ROUNDS_FROM rounds a step is weighed with beside its plan, which keeps
    `resident` layers on the device: none, and half as many, unless the caller fixed the cap.
    The search's per-round estimate rates a resident layer's saved fetches as if every round
    paid them; with a round or two a step the compiled step hides most of those fetches behind
    compute, and the memory is worth more as saved activations (8b at 80 / 24 on the h100
    profile as one of 64 split replicas, one round of two 8k chunks: 8 resident layers and every
    activation recomputed 2.049 s compiled, none resident and 21 layers' activations kept
    1.967 s)."""
    if "max_resident_layers" in constraints or "tokens_per_step" not in constraints or \
            resident < 1 or not 1 <= ch.rounds_per_step <= FEWER_ROUNDS_FROM:
        return []
    return [{"max_resident_layers": k} for k in sorted({0, resident // 2})]
