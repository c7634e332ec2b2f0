"""The numba host embedding scatter equals the NumPy op table's bit for bit."""

import ml_dtypes
import numpy as np
import pytest

from dataflow.ops_numpy import embedding_bwd as reference_bwd
from dataflow.kernels.host.embedding import embedding_bwd

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("table_dtype", [BF16, np.dtype(np.float32)])
def test_host_embedding_scatter_is_bit_identical_to_reference(rng, table_dtype):
    """Random ids with repeats, random bf16 gradient rows: identical table bits."""
    vocab, dim, tokens = 300, 64, 1000
    ids = rng.integers(0, vocab, tokens)
    dx = rng.standard_normal((tokens, dim)).astype(BF16)
    table = rng.standard_normal((vocab, dim)).astype(table_dtype)
    ours, ref = table.copy(), table.copy()
    embedding_bwd(ids, dx, ours)
    reference_bwd(ids, dx, ref)
    assert np.array_equal(ours.view(np.uint8), ref.view(np.uint8))
