"""models.fp8_quant_fast (the numba quantiser the fp8 base loads with) against its NumPy
reference, models.fp8_quant.quantise_rows, bit for bit: fresh random weights at several scales,
rows whose small values fall among E4M3's subnormals, exact ties between two codes (normal and
subnormal: round to even), signed zeros, zero rows, bf16 and fp32 inputs; inf/NaN refused naming
the same row."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dataflow.models.fp8_quant import quantise_rows
from dataflow.models.fp8_quant_fast import quantise_rows_fast

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _same(w):
    c_ref, s_ref = quantise_rows(w)
    c, s = quantise_rows_fast(w)
    assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    assert np.array_equal(c, c_ref)


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "fp32"])
def test_fast_quantiser_equals_the_reference_on_random_weights(rng, dtype):
    w = rng.standard_normal((67, 300)) * np.exp(3 * rng.standard_normal((67, 1)))
    w[3] = 0.0
    w[5, :] = -0.0
    w[7, 0] = 1e4  # one huge value: the rest of its row among E4M3's subnormals or zero
    _same(w.astype(dtype))


def test_fast_quantiser_rounds_ties_to_even_as_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    finite = np.sort(codes[np.isfinite(codes) & (codes >= 0)])
    mids = (finite[:-1] + finite[1:]) / 2  # exact in fp32: every tie between two codes
    row = np.concatenate([[448.0], mids, -mids, [0.0, -0.0]]).astype(np.float32)
    _same(row[None, :])  # amax 448: scale 1, the ties reach the cast as they are


def test_fast_quantiser_refuses_the_same_non_finite_row():
    w = np.ones((6, 8), np.float32)
    w[4, 2] = np.nan
    w[2, 7] = np.inf
    for fn in (quantise_rows, quantise_rows_fast):
        with pytest.raises(ValueError, match=r"layer\.q: row 2 holds inf or NaN"):
            fn(w, "layer.q")
