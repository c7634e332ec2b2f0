"""dataflow.kernels.host.norms.sumsq on fresh random bf16 and fp32 arrays against a float64 NumPy sum
(float64 partials per piece: agreement to float64 rounding), and its refusal of other dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dataflow.kernels.host.norms import sumsq, sumsq_into


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) * 3 + 7])
def test_sumsq_matches_a_float64_sum(rng, dtype, n):
    x = (rng.standard_normal(n) * 3).astype(dtype)
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert sumsq(x) == pytest.approx(want, rel=1e-12)
    out = np.zeros(1, np.float32)
    sumsq_into(x, out)
    assert out[0] == np.float32(sumsq(x))


def test_sumsq_refuses_other_dtypes():
    with pytest.raises(TypeError, match="bf16 or fp32"):
        sumsq(np.ones(4, np.float64))


def test_the_bf16_table_squares_every_bit_pattern_exactly():
    """BF16_SQUARES[b] is bf16 pattern b's value squared in float64 (8 significant bits: the
    square is exact), NaN where the pattern is NaN."""
    from dataflow.kernels.host.norms import BF16_SQUARES
    with np.errstate(invalid="ignore", over="ignore"):  # the NaN patterns
        values = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        want = values * values
    nan = np.isnan(values)
    assert np.array_equal(np.isnan(BF16_SQUARES), nan)
    assert np.array_equal(BF16_SQUARES[~nan], want[~nan])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_sumsq_carries_inf_and_nan(rng, dtype):
    """One inf makes the norm inf, one NaN makes it NaN (the clip then sees a non-finite step),
    whichever of the four accumulators and the tail holds it."""
    for at in (0, 1, 2, 3, 1001):
        for bad, check in ((np.inf, np.isinf), (np.nan, np.isnan)):
            x = rng.standard_normal(1003).astype(dtype)
            x[at] = bad
            assert check(sumsq(x)), (at, bad)
