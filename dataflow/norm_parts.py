"""Exact squared norms of gradient blocks, independent of how a block is split over replicas
(docs/ring.md "Split updates"): each sub-block of dataflow.memplan.plan.split.SUB_BLOCK
elements is summed in float64 (NumPy, one fixed order per sub-block), and the sub-block sums are
added exactly, as integers in units of 2^-1074 (every finite float64 is one), then rounded to
float64 once. A replica's part (whole sub-blocks) gives its exact integer as LIMBS fixed-width
limbs, so the replicas' parts add to the whole block's bits. Never touches a device or a
transport; the callers move the limbs."""

from __future__ import annotations

import math

import numpy as np

from dataflow.memplan.plan.split import SUB_BLOCK

UNIT_EXP = 1074
"""Exact sums count units of 2^-UNIT_EXP, the smallest positive float64 (subnormal)."""
LIMB_BITS = 32
LIMBS = 68
"""Fixed-width limbs of an exact partial sum: 68 x 32 = 2176 bits hold 2^2098 (the largest
float64 in units) times 2^78 sub-block sums, far more than any block has."""
SPECIAL = LIMBS
"""Index, after the limbs, of the partial's float sum of its non-finite sub-block sums (0.0
when all are finite): a NaN or an infinity wins over the exact part, the same on every path."""
WIDTH = LIMBS + 1
"""Values per encoded partial: the limbs, then the non-finite sum."""


def sub_block_sums(x: np.ndarray) -> np.ndarray:
    """Each sub-block's float64 sum of squares of the flat array `x` (which starts at a
    sub-block boundary; the last sub-block may be short): shape (ceil(n / SUB_BLOCK),). Every
    full sub-block is one row of a (rows, SUB_BLOCK) reduction, which NumPy sums row by row
    with the 1-D pairwise sum of SUB_BLOCK elements whatever the row count
    (tests/dataflow/test_norm_parts.py checks it), so a part's sums are the whole block's."""
    flat = x.reshape(-1)
    n = flat.size
    full = n // SUB_BLOCK
    out = np.empty(-(-n // SUB_BLOCK), np.float64)
    if full:
        sub = flat[:full * SUB_BLOCK].astype(np.float64).reshape(full, SUB_BLOCK)
        out[:full] = np.sum(sub * sub, axis=1)
    if n > full * SUB_BLOCK:
        sub = flat[full * SUB_BLOCK:].astype(np.float64)
        out[full] = np.sum(sub * sub)
    return out


def exact_units(values: np.ndarray) -> tuple[int, float]:
    """The exact sum of the finite float64 `values` as a Python int in units of 2^-1074, and
    the float sum of the non-finite ones (0.0 if none)."""
    v = np.asarray(values, np.float64).reshape(-1)
    finite = np.isfinite(v)
    special = float(np.sum(v[~finite])) if not finite.all() else 0.0
    v = v[finite]
    mant, exp = np.frexp(v)  # v = mant * 2^exp, 0.5 <= |mant| < 1 (0 for v = 0)
    m = (mant * float(1 << 53)).astype(np.int64)  # exact: 53 significant bits
    shift = exp.astype(np.int64) - 53 + UNIT_EXP  # v = m * 2^(shift - 1074), shift >= 0
    total = 0
    for s in np.unique(shift):
        total += sum(m[shift == s].tolist()) << int(s)
    return total, special


def to_float(units: int, special: float = 0.0) -> float:
    """An exact sum in units of 2^-1074 rounded to float64 once (Python's int division is
    correctly rounded; inf past float64's range); a non-finite `special` wins."""
    if special != 0.0 or math.isnan(special):
        return special
    try:
        return units / (1 << UNIT_EXP)
    except OverflowError:
        return math.inf


def block_sumsq(x: np.ndarray) -> float:
    """The squared norm of a whole block (or of any array starting at a sub-block boundary):
    the sub-block sums added exactly, rounded to float64 once."""
    return to_float(*exact_units(sub_block_sums(x)))


def encode(units: int, special: float) -> np.ndarray:
    """A partial as WIDTH float64 values (32-bit limbs, least significant first, each exact in
    float64; then the non-finite sum) for an all-gather row."""
    if units < 0 or units.bit_length() > LIMBS * LIMB_BITS:
        raise ValueError(f"exact sum of {units.bit_length()} bits does not fit {LIMBS} limbs")
    mask = (1 << LIMB_BITS) - 1
    out = np.empty(WIDTH, np.float64)
    for i in range(LIMBS):
        out[i] = float((units >> (i * LIMB_BITS)) & mask)
    out[SPECIAL] = special
    return out


def decode(row: np.ndarray) -> tuple[int, float]:
    """encode's inverse: (units, non-finite sum)."""
    units = 0
    for i in reversed(range(LIMBS)):
        units = (units << LIMB_BITS) | int(row[i])
    return units, float(row[SPECIAL])


def add_partials(partials) -> float:
    """The float64 squared norm of a block from its replicas' encoded partials (any order: the
    integers add exactly; the non-finite sums of squares are +inf or NaN, which add alike)."""
    units, special = 0, 0.0
    for row in partials:
        u, s = decode(np.asarray(row))
        units, special = units + u, special + s
    return to_float(units, special)
