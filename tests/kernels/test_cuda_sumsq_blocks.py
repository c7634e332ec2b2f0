"""sumsq_blocks (kernels/cuda/utils.cu): each 1,024-element sub-block's float64 sum of squares
of bf16 / fp32 gradients, the device half of the exact norms of replicas (dataflow.norm_parts,
dataflow.ring.executor.device_norm_sums). Checked against norm_parts.sub_block_sums on fresh
random inputs (float64 sums of exact squares in another order: within a few float64 ulps), and
for the property split updates need: a part starting at a sub-block boundary gives the whole
block's sums for its sub-blocks bit for bit, every run. GPU only."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import require_gpu

cp = require_gpu()

from dataflow import norm_parts  # noqa: E402
from dataflow.memplan.plan.split import SUB_BLOCK  # noqa: E402
from dataflow.ops_cuda import CudaOps  # noqa: E402
from tests.gpu import BF16, F32, cuda_context, dev, sync  # noqa: E402

pytestmark = pytest.mark.gpu
OPS = CudaOps(cuda_context())


def _sums(x_dev) -> np.ndarray:
    out = cp.full(-(-x_dev.size // SUB_BLOCK), np.nan, cp.float64)
    OPS.sumsq_blocks(x_dev, out)
    sync()
    return cp.asnumpy(out)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_sumsq_blocks_matches_norm_parts_and_parts_keep_the_bits(rng, dtype):
    """Ragged sizes (a short last sub-block): every sub-block's sum within 1e-12 relative of
    NumPy's; a part from any sub-block boundary (as a split replica holds) and a second run
    give the same bits; the exact sum added on the host is within 1e-12 of NumPy's."""
    for n in (1, SUB_BLOCK - 3, 5 * SUB_BLOCK + 129, 37 * SUB_BLOCK):
        x = (rng.standard_normal(n) * 3).astype(np.float32).astype(dtype)
        d = dev(x)
        got = _sums(d)
        want = norm_parts.sub_block_sums(x)
        assert got.shape == want.shape and np.all(np.isfinite(got)), n
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        assert np.array_equal(_sums(d), got), n  # deterministic
        for start in sorted({0, 1, got.size // 2, got.size - 1}):
            part = _sums(d[start * SUB_BLOCK:])
            assert np.array_equal(part, got[start:]), (n, start)
        exact = norm_parts.to_float(*norm_parts.exact_units(got))
        assert abs(exact - norm_parts.block_sumsq(x)) <= 1e-12 * exact, n


def test_sumsq_blocks_refuses_a_wrong_output_length(rng):
    """The output must hold ceil(n / 1024) float64 values; the error says how many."""
    x = dev(rng.standard_normal(3 * SUB_BLOCK).astype(np.float32))
    with pytest.raises(ValueError, match="writes 3 values"):
        OPS.sumsq_blocks(x, cp.empty(2, cp.float64))
