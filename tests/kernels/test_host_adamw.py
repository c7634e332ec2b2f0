"""The numba host AdamW equals the reference AdamW bit for bit."""

import ml_dtypes
import numpy as np
import pytest

from dataflow.ops_numpy import adamw_step as reference_step
from dataflow.kernels.host.adamw import adamw_step

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("grad_dtype", [BF16, np.dtype(np.float32)])
@pytest.mark.parametrize("n", [1000, 200_003])
def test_host_adamw_is_bit_identical_to_reference(rng, grad_dtype, n):
    """Random bf16 state, bf16 or fp32 gradient, several steps: identical bits every step."""
    p = rng.standard_normal(n).astype(BF16)
    g = (rng.standard_normal(n) * 1e-3).astype(grad_dtype)
    m = (rng.standard_normal(n) * 1e-4).astype(BF16)
    v = (rng.random(n) * 1e-7).astype(BF16)
    ours = [x.copy() for x in (p, g, m, v)]
    ref = [x.copy() for x in (p, g, m, v)]
    for step in (1, 2, 7):
        adamw_step(*ours, step, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.37)
        reference_step(*ref, step, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.37)
        for a, b in zip(ours, ref):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
