"""The FP8-stored frozen base's decode on the GPU (kernels/cuda/fp8_base.cu) against its NumPy
reference (kernels/reference/fp8_base.py) on fresh random inputs: every one of the 256 E4M3 codes
(NaN's bits included) and rows quantised by models.fp8_quant, bit for bit, on the 4-wide path
(columns a multiple of 4) and the 1-wide one (an odd width, an offset view). Needs no FP8
hardware (the decode is by hand), only a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.kernels.reference.fp8_base import fp8_base_dequant
from dataflow.models.fp8_quant import quantise_rows
from tests.gpu import BF16, cuda_context, dev, host, poisoned, require_gpu, same_bits

cp = require_gpu()

# Imported after the GPU check: the package needs CuPy.
import dataflow.kernels.cuda as kc  # noqa: E402

pytestmark = pytest.mark.gpu
CTX = cuda_context()


def _gpu(codes, scales):
    out = poisoned(codes.shape, BF16)
    kc.fp8_base_dequant(CTX, dev(codes), dev(scales), out)
    return host(out)


@pytest.mark.parametrize("cols", [256, 4, 7])
def test_fp8_base_dequant_decodes_every_code_as_the_reference(cols):
    """All 256 codes (each row a permutation of them, random fp32 scales): equal bits."""
    seed = 41 + cols
    print("seed", seed)
    rng = np.random.default_rng(seed)
    rows = 64
    codes = np.stack([rng.permutation(256)[:cols] for _ in range(rows)]).astype(np.uint8)
    codes[0, 0], codes[1, 0] = 0x7F, 0xFF  # the format's NaNs
    scales = (10.0 ** rng.uniform(-6, 2, rows)).astype(np.float32)
    got, want = _gpu(codes, scales), fp8_base_dequant(codes, scales)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.mark.parametrize("shape", [(512, 1024), (1000, 36), (33, 129)])
def test_fp8_base_dequant_matches_the_reference_on_quantised_weights(shape):
    """A random bf16 weight quantised per row, decoded on the GPU: the reference's bits."""
    seed = shape[0] + shape[1]
    print("seed", seed)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(BF16)
    codes, scales = quantise_rows(w)
    assert same_bits(_gpu(codes, scales), fp8_base_dequant(codes, scales))


def test_fp8_base_dequant_on_an_unaligned_view_takes_the_narrow_path():
    """Codes starting 1 byte into their buffer (not 4-byte aligned): still the reference's."""
    rng = np.random.default_rng(9)
    buf = cp.asarray(rng.integers(0, 256, 1 + 96 * 64, dtype=np.uint8))
    codes = buf[1:].reshape(96, 64)
    scales = rng.uniform(0.01, 1, 96).astype(np.float32)
    out = poisoned((96, 64), BF16)
    kc.fp8_base_dequant(CTX, codes, dev(scales), out)
    want = fp8_base_dequant(cp.asnumpy(codes), scales)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(host(out).view(np.uint16)[~nan], want.view(np.uint16)[~nan])
