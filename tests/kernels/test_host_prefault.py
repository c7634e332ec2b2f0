"""dataflow.kernels.host.memory.prefault_zero: faulting in a fresh mapping from all threads changes no
byte of memory that reads as zero, at any length, and refuses arrays it cannot treat as bytes."""

import mmap

import numpy as np
import pytest

from dataflow.kernels.host.memory import PAGE_BYTES, prefault_zero


@pytest.mark.parametrize("n", [1, PAGE_BYTES - 1, PAGE_BYTES, 5 * PAGE_BYTES + 3, 3 << 20])
def test_prefault_zero_leaves_a_fresh_mapping_all_zero_and_resident(n):
    """A fresh anonymous mapping of any length reads as zero after the touch, and every page of
    it is resident (mincore is not in Python: the RSS of the mapping is not checked, the bytes
    are)."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8, n)
    prefault_zero(a)
    assert not a.any()
    del a
    m.close()


def test_prefault_zero_writes_only_the_first_byte_of_each_page(rng):
    """The touch writes exactly one byte per page (offset 0): the bytes between stay as they
    were, which is why it is only for memory that already reads as zero."""
    n = 4 * PAGE_BYTES + 17
    a = rng.integers(1, 256, n, dtype=np.uint8)
    before = a.copy()
    prefault_zero(a)
    touched = np.arange(0, n, PAGE_BYTES)
    assert not a[touched].any()
    keep = np.ones(n, bool)
    keep[touched] = False
    assert np.array_equal(a[keep], before[keep])


def test_prefault_zero_refuses_a_strided_view():
    """A non-contiguous view is refused with the fix in the message."""
    with pytest.raises(ValueError, match="C-contiguous"):
        prefault_zero(np.zeros(64, np.uint8)[::2])
