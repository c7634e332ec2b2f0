"""dataflow.norm_parts: a block's squared norm is its sub-blocks' float64 sums added exactly
and rounded once, so any split into runs of whole sub-blocks (any number of replicas, in any
order) gives the whole block's bits; the NumPy backend's sumsq computes exactly that."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np

from dataflow import norm_parts
from dataflow.memplan.plan.split import SUB_BLOCK, part_bounds
from dataflow.ops_numpy import sumsq


def _block(rng, n: int) -> np.ndarray:
    scale = np.exp(rng.uniform(-30, 30, n))  # widely spread magnitudes: rounding matters
    return (rng.standard_normal(n) * scale).astype(ml_dtypes.bfloat16)


def test_exact_sum_is_the_correctly_rounded_sum_of_the_sub_block_sums(rng):
    """block_sumsq = the exact rational sum of the sub-block sums rounded once (Fraction, and
    math.fsum, which also rounds the exact sum once), and independent of their order."""
    for n in (1, 1000, 1024, 1025, 5 * 1024 + 17, 46208):
        x = _block(rng, n)
        sums = norm_parts.sub_block_sums(x)
        want = float(sum(Fraction(float(s)) for s in sums))
        assert norm_parts.block_sumsq(x) == want == math.fsum(sums.tolist()), n
        units, special = norm_parts.exact_units(rng.permutation(sums))
        assert special == 0.0 and norm_parts.to_float(units) == want


def test_parts_of_any_replica_count_add_to_the_whole_blocks_bits(rng):
    """Replica parts (part_bounds) encoded as limbs and added in any order give the whole
    block's float64 and so sumsq's fp32, for R = 1..5."""
    for n in (46208, 32832, 3 * SUB_BLOCK, 7 * SUB_BLOCK + 5):
        x = _block(rng, n)
        whole = norm_parts.block_sumsq(x)
        out = np.zeros(1, np.float32)
        sumsq(x, out, False)
        assert out[0] == np.float32(whole)
        for r in range(1, 6):
            b = part_bounds(n, r)
            rows = [norm_parts.encode(*norm_parts.exact_units(norm_parts.sub_block_sums(
                x[lo:hi]))) for lo, hi in zip(b, b[1:])]
            assert norm_parts.add_partials(rows) == whole, (n, r)
            assert norm_parts.add_partials(rows[::-1]) == whole, (n, r)


def test_sub_block_rows_sum_as_one_dimensional_sums(rng):
    """The premise of sub_block_sums: NumPy's row sums of a (rows, 1024) float64 array equal
    each row's own 1-D sum, whatever the number of rows."""
    for rows in (1, 2, 3, 17, 300):
        a = np.square(rng.standard_normal((rows, SUB_BLOCK)))
        got = np.sum(a, axis=1)
        assert all(got[i] == np.sum(a[i].copy()) for i in range(rows)), rows


def test_non_finite_sums_win_alike_on_every_path():
    """An infinite or NaN gradient gives inf or NaN whether summed whole or in parts."""
    x = np.ones(3 * SUB_BLOCK, np.float32)
    x[2000] = np.inf
    assert norm_parts.block_sumsq(x) == math.inf
    b = part_bounds(x.size, 3)
    rows = [norm_parts.encode(*norm_parts.exact_units(norm_parts.sub_block_sums(x[lo:hi])))
            for lo, hi in zip(b, b[1:])]
    assert norm_parts.add_partials(rows) == math.inf
    x[10] = np.nan
    assert math.isnan(norm_parts.block_sumsq(x))
