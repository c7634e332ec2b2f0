"""dataflow.kernels.host.memory: the parallel zero-fill and copy leave exactly the bytes `a[...] = 0` and
`dst[...] = src` would, at any alignment and length, and skip nothing that is not zero."""

import ml_dtypes
import numpy as np
import pytest

from dataflow.kernels.host.memory import PAGE_BYTES, copy_into, zero_fill


def _patchy(rng, n: int) -> np.ndarray:
    """Random bytes with whole zero pages, single stray bytes and zero runs mixed in."""
    buf = rng.integers(0, 256, n, dtype=np.uint8)
    for lo in rng.integers(0, max(1, n - PAGE_BYTES), 6):
        buf[lo:lo + int(rng.integers(1, 3 * PAGE_BYTES))] = 0
    buf[rng.integers(0, n, 4)] = 0
    return buf


@pytest.mark.parametrize("n", [1, 7, 4095, 3 * PAGE_BYTES + 5, (1 << 20) + 4099])
def test_zero_fill_clears_every_byte_at_any_offset_and_length(rng, n):
    """Unaligned starts (1..7 bytes past a boundary) and odd lengths: every byte ends zero and
    the bytes around the view are untouched."""
    start = int(rng.integers(1, 8))
    outer = _patchy(rng, n + 16)
    outer[start + n:] = rng.integers(1, 256, outer.size - start - n, dtype=np.uint8)
    before = outer.copy()
    zero_fill(outer[start:start + n])
    assert not outer[start:start + n].any()
    assert np.array_equal(outer[:start], before[:start])
    assert np.array_equal(outer[start + n:], before[start + n:])


def test_zero_fill_clears_a_single_stray_bit_in_an_otherwise_zero_page(rng):
    """A page that reads as zero but for one bit is still written (the skip is a real test)."""
    a = np.zeros(8 * PAGE_BYTES, np.uint8)
    where = rng.integers(0, a.size, 3)
    a[where] = np.uint8(1) << rng.integers(0, 8, 3).astype(np.uint8)
    zero_fill(a.view(np.uint16).view(ml_dtypes.bfloat16))
    assert not a.any()


def test_zero_fill_of_a_typed_view_matches_numpy_assignment(rng):
    """On bf16 and fp32 views (negative zeros and NaNs included) the bytes equal `a[...] = 0`."""
    for dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
        raw = _patchy(rng, 6 * PAGE_BYTES + 12)
        ours, ref = raw.copy().view(dt), raw.copy().view(dt)
        ref[...] = 0
        zero_fill(ours)
        assert np.array_equal(ours.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("n", [3, 4096 * 3 + 1, (1 << 20) * 2 + 17])
def test_copy_into_copies_bytes_exactly_across_dtypes(rng, n):
    """bf16 bits into a uint8 slab view at an odd offset: the same bytes as np.copyto."""
    src = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(ml_dtypes.bfloat16)
    slab = rng.integers(0, 256, 2 * n + 9, dtype=np.uint8)
    ref = slab.copy()
    ref[3:3 + 2 * n] = src.view(np.uint8)
    copy_into(slab[3:3 + 2 * n], src)
    assert np.array_equal(slab, ref)


def test_copy_into_refuses_unequal_sizes_and_strided_views(rng):
    """A size mismatch names both byte counts; a strided view is refused with the fix."""
    a = rng.integers(0, 9, 16, dtype=np.uint8)
    with pytest.raises(ValueError, match="8 source bytes into a 16-byte destination"):
        copy_into(a, a[:8].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        zero_fill(a[::2])
