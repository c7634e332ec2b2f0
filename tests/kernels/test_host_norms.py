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
