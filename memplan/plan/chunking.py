"""Chunk-size and chunks-per-round candidates for a model and sequence length: pack short
sequences into one chunk, split long ones into ordered chunks that attend to earlier chunks' K/V.
Never imports array libraries."""

from __future__ import annotations

from dataflow.memplan.plan.decisions import validate_chunking
from dataflow.memplan.plan.plan import Chunking
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

CHUNK_TARGET_TOKENS = 8192
"""Smallest chunk with good arithmetic intensity on a large model (ml_dataflow's minimum)."""
CHUNK_TARGET_FULL_DIM = 2048
"""Models at least this wide use the full target; narrower ones scale it down in proportion."""
MIN_CHUNK_TARGET_TOKENS = 128
ROUND_MULTIPLES = (1, 2, 4)
"""Chunks per round tried, as multiples of the fewest that hold whole sequences."""
MAX_ROUND_TOKENS = 1 << 17
"""Extra chunks per round are only tried while a round stays at most this many tokens."""
MAX_CHUNKS_PER_SEQ = 256
"""A sequence is split into at most this many chunks (longer chunks past it): the cost model's
work grows with chunks per round, and this keeps planning any seqlen up to MAX_SEQLEN under a
second. Only sequences longer than 256 chunk targets (2M tokens on 8b) are affected."""
HEAD_SUB_TARGET_TOKENS = 1024
"""Head/cross-entropy sub-chunk: the smallest divisor of the chunk at least this long."""
HEAD_SUB_TARGETS = (HEAD_SUB_TARGET_TOKENS, 2048)
"""Sub-chunk targets a chosen plan may take (dataflow.memplan.search.search._longer_head_sub): a longer one
holds more fp32 logits on the device (0.5 GiB more at 2048 for a 128k vocabulary) and
accumulates the head's weight gradient half as often (dataflow.memplan.search.cost.head_seconds)."""


def chunk_target_tokens(cfg: ModelConfig) -> int:
    """8192 for models at least 2048 wide, scaled down (to a power of two) for narrower ones."""
    want = CHUNK_TARGET_TOKENS * cfg.model_dim // CHUNK_TARGET_FULL_DIM
    target = MIN_CHUNK_TARGET_TOKENS
    while target * 2 <= min(want, CHUNK_TARGET_TOKENS):
        target *= 2
    return target


MAX_SEQLEN = 1 << 24
"""Longest sequence the planner accepts (16,777,216 tokens, 16x the 1M-token step cap of
dataflow.memplan.search.cost): planning any seqlen up to it takes well under a second, and a step of even one
such sequence is past any budget we can plan for. Checked by chunk_candidates and make_chunking
(and at the CLIs' edge)."""


def check_seqlen(seqlen) -> int:
    """`seqlen` itself when it is a whole number of tokens in [1, MAX_SEQLEN]; else ConfigError."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise ConfigError(f"seqlen {seqlen!r} must be a positive whole number of tokens")
    if seqlen > MAX_SEQLEN:
        raise ConfigError(f"seqlen {seqlen:,} is above the {MAX_SEQLEN:,} tokens the planner "
                          f"handles; use at most {MAX_SEQLEN:,}")
    return seqlen


def _divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, from its prime factors: trial division stops at the
    square root of what is left, so a power of two or a smooth number costs a few steps and
    the worst case (a prime near MAX_SEQLEN) about 4,096."""
    factors: list[tuple[int, int]] = []
    rest, p = n, 2
    while p * p <= rest:
        if rest % p == 0:
            k = 0
            while rest % p == 0:
                rest //= p
                k += 1
            factors.append((p, k))
        p += 1 if p == 2 else 2
    if rest > 1:
        factors.append((rest, 1))
    divs = [1]
    for p, k in factors:
        divs = [d * p**e for d in divs for e in range(k + 1)]
    return sorted(divs)


def chunk_candidates(cfg: ModelConfig, seqlen: int) -> tuple[int, ...]:
    """Chunk sizes the search tries: the target (smallest multiple of seqlen, or divisor of it,
    at least the target), one twice as large, and one about a quarter as large for tight
    device budgets."""
    check_seqlen(seqlen)
    target = chunk_target_tokens(cfg)
    if seqlen <= target:
        base = -(-target // seqlen)
        spcs = sorted({max(1, base // 4), base, 2 * base})
        return tuple(s * seqlen for s in spcs)
    divs = _divisors(seqlen)
    base = next(d for d in divs if d >= max(target, -(-seqlen // MAX_CHUNKS_PER_SEQ)))
    out = {base, next((d for d in divs if d >= 2 * base), base)}
    out.add(next((d for d in divs if d >= max(1, base // 4)), base))
    return tuple(sorted(out))


def make_chunking(seqlen: int, chunk_tokens: int, chunks_per_round: int | None = None,
                  rounds_per_step: int = 1) -> Chunking:
    """A valid Chunking; `chunks_per_round` defaults to the fewest holding whole sequences."""
    check_seqlen(seqlen)
    if seqlen <= chunk_tokens:
        if chunk_tokens % seqlen:
            fit = -(-chunk_tokens // seqlen) * seqlen
            raise ConfigError(f"chunk_tokens {chunk_tokens} must be a multiple of seqlen "
                              f"{seqlen} to pack whole sequences; try {fit}")
        spc, cps = chunk_tokens // seqlen, 1
    else:
        if seqlen % chunk_tokens:
            raise ConfigError(f"chunk_tokens {chunk_tokens} must divide seqlen {seqlen} to split "
                              "sequences into equal chunks")
        spc, cps = 1, seqlen // chunk_tokens
    ch = Chunking(seqlen=seqlen, chunk_tokens=chunk_tokens, seqs_per_chunk=spc,
                  chunks_per_seq=cps, chunks_per_round=chunks_per_round or cps,
                  rounds_per_step=rounds_per_step)
    validate_chunking(ch)
    return ch


def chunking_candidates(cfg: ModelConfig, seqlen: int, *, chunk_tokens: int | None = None,
                        chunks_per_round: int | None = None) -> tuple[Chunking, ...]:
    """Every (chunk size, chunks per round) pair the search tries, rounds_per_step left at 1."""
    sizes = (chunk_tokens,) if chunk_tokens else chunk_candidates(cfg, seqlen)
    out = []
    for t in sizes:
        base = make_chunking(seqlen, t)
        if chunks_per_round:
            out.append(make_chunking(seqlen, t, chunks_per_round))
            continue
        for m in ROUND_MULTIPLES:
            cpr = base.chunks_per_seq * m
            if m == 1 or cpr * t <= MAX_ROUND_TOKENS:
                out.append(make_chunking(seqlen, t, cpr))
    return tuple(out)


def head_sub_tokens(chunk_tokens: int, target: int = HEAD_SUB_TARGET_TOKENS) -> int:
    """The smallest divisor of the chunk at least `target` tokens long (the chunk itself when
    it is shorter)."""
    return next(d for d in _divisors(chunk_tokens) if d >= min(target, chunk_tokens))


def head_sub_choices(chunk_tokens: int) -> tuple[int, ...]:
    """The head sub-chunks a plan of this chunk may take (HEAD_SUB_TARGETS, deduplicated)."""
    return tuple(sorted({head_sub_tokens(chunk_tokens, t) for t in HEAD_SUB_TARGETS}))
