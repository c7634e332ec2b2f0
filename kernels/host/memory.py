"""Parallel zero-fill, copy and first touch of large host buffers (numba, prange over pages or
1 MiB pieces), for the engine's setup: faulting in a fresh host slab before it is pinned,
clearing home gradients and AdamW state, copying loaded blocks into pinned memory. Works on any
C-contiguous array as raw bytes, so the result is bit-for-bit what `a[...] = 0` or
`dst[...] = src` would leave. Never allocates and never touches a device."""

from __future__ import annotations

import numba
import numpy as np

PIECE_BYTES = 1 << 20
"""Bytes per parallel work item: large enough that thread start-up is noise, small enough that
16 threads share a 0.4 GiB block evenly."""
PAGE_BYTES = 4096
"""Granularity of the already-zero test: one OS page, so a page nobody wrote is never written."""


@numba.njit(parallel=True, cache=True)
def _zero_nonzero_pages(words, page):
    """words: uint64; page in words."""
    n = words.size
    for q in numba.prange((n + page - 1) // page):
        seg = words[q * page:min(n, (q + 1) * page)]
        acc = np.uint64(0)
        for j in range(seg.size):  # an OR reduction over a slice: vectorised, read-only
            acc |= seg[j]
        if acc != 0:
            seg[:] = 0


@numba.njit(parallel=True, cache=True, nogil=True)  # setup's prebuild thread runs meanwhile
def _touch_pages(buf, page):
    """One zero byte per page; numba's prange hands each thread one contiguous range, so a
    thread faults in whole huge pages where the kernel backs the mapping with them."""
    for q in numba.prange((buf.size + page - 1) // page):
        buf[q * page] = 0


@numba.njit(parallel=True, cache=True)
def _copy_pieces(dst, src, piece):
    n = dst.size
    for p in numba.prange((n + piece - 1) // piece):
        lo = p * piece
        hi = min(n, lo + piece)
        dst[lo:hi] = src[lo:hi]


def _bytes(a: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous NumPy array, got "
                         f"{type(a).__name__}; pass np.ascontiguousarray(...)")
    return a.reshape(-1).view(np.uint8)


def zero_fill(a: np.ndarray) -> None:
    """Set every byte of `a` to zero, in parallel. Pages that already read as zero are left
    unwritten: reading is cheaper than writing, and a fresh zeroed slab (calloc'd, or pages the
    OS has just handed out) then never has its pages faulted in or dirtied for nothing."""
    buf = _bytes(a, "zero_fill's array")
    head = min(buf.size, -buf.ctypes.data % 8)  # bytes before the first 8-byte boundary
    tail = (buf.size - head) % 8
    buf[:head] = 0
    buf[buf.size - tail:] = 0
    words = buf[head:buf.size - tail].view(np.uint64)
    if words.size:
        _zero_nonzero_pages(words, PAGE_BYTES // 8)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src byte for byte, in parallel; both C-contiguous with equal byte counts (the
    dtypes need not match: bf16 bits into a bf16 view of a uint8 slab, for example)."""
    d, s = _bytes(dst, "copy_into's destination"), _bytes(src, "copy_into's source")
    if d.size != s.size:
        raise ValueError(f"copy_into: {s.size} source bytes into a {d.size}-byte destination; "
                         "pass arrays of the same size in bytes")
    if d.size:
        _copy_pieces(d, s, PIECE_BYTES)


def prefault_zero(a: np.ndarray) -> None:
    """Fault in every page of `a` from all threads by writing one zero byte per page: the
    kernel's page zeroing, which a single thread would otherwise do inside cudaHostRegister or
    cudaHostAlloc, then runs in parallel. ONLY for memory that already reads as zero (a fresh
    anonymous mapping): it writes zeros, so on such memory it changes no byte."""
    buf = _bytes(a, "prefault_zero's array")
    if buf.size:
        _touch_pages(buf, PAGE_BYTES)
